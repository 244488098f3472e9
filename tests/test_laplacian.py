"""jaxamp._src.derivatives.laplacian: the scaled Laplacian by collapsed Taylor mode, and its baselines.

Oracles: ``jnp.trace(jax.hessian(f))`` (float32 to rounding, float64 to 1e-12) and the sum of
:func:`jaxamp._src.taylor.second_order` over the directions; every method gives the same value. On
a float32 network, scales ``2**k`` give bit-identical values (binary scaling commutes with
rounding); on a float16 network a too-large input factor overflows key "2" at scale 1 and not
at a small scale; the value is differentiable with respect to the parameters through
:func:`jaxamp.scaled` and composes with ``vmap`` and ``jit``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

import jaxamp
from jaxamp._src import taylor
from jaxamp._src.derivatives.laplacian import METHODS, laplacian
from jaxamp._src.core.profile import scaler_keys
from jaxamp._src.core.marks import NONFINITE_VALUES
from jaxamp._src.taylor.collapsed import collapsed_second_order

SCALES = {"1": 2.0**-3, "2": 2.0**-7}
ONES = {"1": 1.0, "2": 1.0}


def init(d, width=16, depth=2, seed=0):
    sizes = [d] + [width] * depth + [1]
    out = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed + i))
        out.append((jax.random.normal(k1, (b, a)) / np.sqrt(a), 0.1 * jax.random.normal(k2, (b,))))
    return out


def mlp(params, x, dtype=None):
    """tanh and sin layers; ``dtype``: the layers compute in it (params cast inside)."""
    h = x if dtype is None else x.astype(dtype)
    for i, (w, b) in enumerate(params):
        w, b = (w, b) if dtype is None else (w.astype(dtype), b.astype(dtype))
        h = w @ h + b
        if i < len(params) - 1:
            h = jnp.tanh(h) if i % 2 == 0 else jnp.sin(h)
    return h[0].astype(x.dtype)


def trace_hessian(f, argnums=1, indices=None):
    def lap(*args):
        h = jax.hessian(f, argnums)(*args)
        return jnp.trace(h) if indices is None else sum(h[i, i] for i in indices)

    return lap


def points(d, n=4, seed=1, dtype=jnp.float32):
    return jax.random.uniform(jax.random.PRNGKey(seed), (n, d), dtype, -1.0, 1.0)


def all_methods(f, methods=tuple(METHODS), subset=None):
    """``{method: Laplacian per point}``, ``"ref"`` (the trace of the Hessian) and, with
    ``subset``, ``"sub"``/``"sub_ref"`` over those indices: one jitted program."""

    def run(params, x):
        fns = {m: laplacian(f, 1, method=m) for m in methods}
        fns["ref"] = trace_hessian(f)
        if subset is not None:
            fns.update(sub=laplacian(f, 1, indices=subset), sub_ref=trace_hessian(f, indices=subset))
        return {m: jax.vmap(fn, (None, 0))(params, x) for m, fn in fns.items()}

    return jax.jit(run)


def assert_close(got, ref, rtol, msg=""):
    assert got.dtype == ref.dtype and got.shape == ref.shape, msg
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(ref))), err_msg=msg)


def assert_methods_equal(values, rtol):
    if "sub" in values:
        assert_close(values.pop("sub"), values.pop("sub_ref"), rtol, "indices")
    ref = values.pop("ref")
    for method, got in values.items():
        assert_close(got, ref, rtol, method)


# d = 3 in the fast suite; d = 2 and 8 with -m slow.
DIMS = [pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(8, marks=pytest.mark.slow)]


@pytest.mark.parametrize("d", DIMS)
def test_every_method_is_the_trace_of_the_hessian_float32(d):
    params, x = init(d), points(d)
    assert_methods_equal(all_methods(mlp, subset=(0, d - 1) if d > 2 else None)(params, x), 1e-5)


@pytest.mark.parametrize("d", DIMS)
def test_float64_every_method(d):
    """Every method at d = 3; the collapsed one (and a subset of the inputs) at d = 2 and 8."""
    with jax.enable_x64(True):
        params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), init(d))
        x = points(d, dtype=jnp.float64)
        methods = tuple(METHODS) if d == 3 else ("collapsed",)
        values = all_methods(mlp, methods, subset=[1, 2] if d == 8 else None)(params, x)
        assert values["collapsed"].dtype == jnp.float64
        assert_methods_equal(values, 1e-12)


def test_collapsed_equals_summed_second_order():
    params, x = init(3), points(3)[0]
    f = lambda z: mlp(params, z)  # noqa: E731

    @jax.jit
    def both(x):
        ours = collapsed_second_order(f, x, 2.0 * jnp.eye(3), (jnp.float32(0.5), jnp.float32(0.5)))[1:]
        theirs = jax.vmap(lambda e: taylor.second_order(f, x, 2.0 * e, jnp.float32(0.25))[1:])(jnp.eye(3))
        return ours, theirs

    (first, lap), (firsts, seconds) = both(x)
    np.testing.assert_allclose(first, firsts, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lap, seconds.sum(), rtol=1e-5)


@jax.custom_vjp
def _cube(v):
    return v**3


_cube.defvjp(lambda v: (v**3, v), lambda v, g: (3 * v**2 * g,))


def _every_primitive(x):
    """One scalar through the rule table: elementwise, linear, shape, bilinear, calls, fallback."""
    a = jnp.concatenate([jnp.sin(x), jnp.cos(x[:2]) - x[1:3] / (2.0 + x[:2] ** 2)])  # [5]
    b = jnp.reshape(jnp.tanh(a[:4]), (2, 2)).T  # reshape, transpose
    c = jnp.squeeze(jnp.expand_dims(b, 0), 0) @ b  # dot_general, both operands dependent
    e = jnp.exp(-jnp.square(c)) + jnp.log(2.0 + c) + (1.5 + c) ** 1.5 + (-c) * c
    f = jnp.where(x[0] > 0, e, 2.0 * e)  # select_n
    g = jax.jit(lambda v: jax.nn.softplus(v) * v)(f)  # pjit, custom_jvp
    h = lax.cumsum(g.reshape(-1)) + jnp.sort(g.reshape(-1))  # no rule: nested jvp
    k = lax.fori_loop(0, 2, lambda i, v: jnp.sin(v) * 1.1, h)  # a loop: nested jvp
    return (k * jnp.broadcast_to(x[2], (4,))).sum() + jnp.sum(_cube(x))  # custom_vjp


def test_every_rule_against_the_hessian_float64():
    with jax.enable_x64(True):
        scalar = lambda t: jnp.sin(t) * t**2  # noqa: E731  a scalar argument

        @jax.jit
        def both(x, t):
            return (laplacian(_every_primitive)(x), jnp.trace(jax.hessian(_every_primitive)(x)),
                    laplacian(scalar)(t), jax.grad(jax.grad(scalar))(t))

        ours, ref, ours_t, ref_t = both(jnp.array([0.3, -0.6, 0.45]), 0.7)
        np.testing.assert_allclose(ours, ref, rtol=1e-12)
        np.testing.assert_allclose(ours_t, ref_t, rtol=1e-12)


def test_keys_and_binary_scaling_on_float32():
    d = 3
    params, x = init(d), points(d)

    def every(p, x):
        return {m: jax.vmap(laplacian(mlp, 1, method=m), (None, 0))(p, x) for m in METHODS}

    assert scaler_keys(every)(params, x) == ("1", "2")
    run = jax.jit(jaxamp.scaled(every))
    one, found = run(ONES, params, x)
    for scales in (SCALES, {"1": 2.0**5, "2": 2.0**-20}):
        values, found = run(scales, params, x)
        for m in METHODS:
            np.testing.assert_array_equal(values[m], one[m], err_msg=m)
        assert not any(bool(v) for v in found.values())
    _, found = run({"1": 1.0, "2": 2.0**127}, params, x)  # the summed second order leaves float32
    assert {k: bool(v) for k, v in found.items()} == {"1": False, "2": True, NONFINITE_VALUES: False}
    # orders: inside a first derivative the keys are 2 and 3; around one, 3; per term: u, u__lap
    u = lambda p, t, x: mlp(p, x * (1.0 + t))  # noqa: E731
    t0 = jnp.float32(0.2)
    u_t = jaxamp.grad(u, 1, of="u", wrt="t")
    assert scaler_keys(laplacian(u_t, 2))(params, t0, x[0]) == ("1", "2", "3")
    assert scaler_keys(jaxamp.grad(laplacian(u, 2), 1))(params, t0, x[0]) == ("1", "2", "3")
    term = jaxamp.AmpConfig(mode="per_term_scaler")
    assert scaler_keys(laplacian(u, 2, of="u"), term)(params, t0, x[0]) == ("u", "u__lap")
    assert scaler_keys(laplacian(u_t, 2), term)(params, t0, x[0]) == ("u", "u__t", "u__t__lap")


def test_float16_overflow_flags_key_2_and_not_at_a_small_scale():
    d, k = 3, 300.0  # second derivatives ~k**2: the summed coefficients leave float16
    params, x = init(d), points(d, n=16)
    u16 = lambda p, x: mlp(p, k * x, jnp.float16)  # noqa: E731
    run = jax.jit(jaxamp.scaled(jax.vmap(laplacian(u16, 1), (None, 0))))
    _, found = run(ONES, params, x)
    assert {k: bool(v) for k, v in found.items()} == {"1": False, "2": True, NONFINITE_VALUES: False}
    values, found = run({"1": 1.0, "2": 2.0**-12}, params, x)
    assert not any(bool(v) for v in found.values())
    ref = jax.jit(jax.vmap(trace_hessian(lambda p, x: mlp(p, k * x)), (None, 0)))(params, x)
    assert_close(values, ref, 0.05)  # float16 rounding of inputs of size k
    _, found = run({"1": 2.0**16, "2": 2.0**-12}, params, x)  # the first-order tangents overflow
    assert bool(found["1"]) and not bool(found[NONFINITE_VALUES])


def test_grad_wrt_params_through_scaled_vmap_jit():
    d = 3
    params, x = init(d), points(d, n=8)

    def loss(p, lap):
        return jnp.mean((jax.vmap(lap, (None, 0))(p, x) - 1.0) ** 2)

    ref_val, ref_grad = jax.jit(jax.value_and_grad(lambda p: loss(p, trace_hessian(mlp))))(params)
    scaled = jaxamp.scaled(lambda p: loss(p, laplacian(mlp, 1)))
    (val, found), grads = jax.jit(jax.value_and_grad(lambda p: scaled(SCALES, p), has_aux=True))(params)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grad)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5 * float(jnp.max(jnp.abs(b))))
    assert not any(bool(v) for v in found.values())
    # a jit inside scaled keeps the checks of the (unused) first-order tangents, which overflow
    # float32 at this seed scale where the network's gradient exceeds 2
    inner = jax.jit(jax.vmap(laplacian(mlp, 1), (None, 0)))
    steep = jax.tree_util.tree_map(lambda w: 4.0 * w, params)
    assert float(jnp.max(jnp.abs(jax.vmap(jax.grad(mlp, 1), (None, 0))(steep, x)))) > 2.0
    _, found = jax.jit(jaxamp.scaled(inner))({"1": 2.0**127, "2": 1.0}, steep, x)
    assert bool(found["1"])


def test_bad_inputs_name_the_argument():
    params, x = init(2), points(2)[0]
    vec = lambda p, x: jnp.tanh(x)  # noqa: E731
    with pytest.raises(TypeError, match=r"`fun`=.*one floating-point scalar \(shape \(\)\), got float32\[2\]"):
        laplacian(vec, 1)(params, x)
    with pytest.raises(TypeError, match="`fun`=.*must be callable"):
        laplacian(3)
    with pytest.raises(TypeError, match="`argnums`=.*must be an int"):
        laplacian(mlp, (0, 1))
    with pytest.raises(ValueError, match=r"`argnums`=5 must index one of the 2 positional arguments"):
        laplacian(mlp, 5)(params, x)
    with pytest.raises(TypeError, match=r"argument 0 \(`argnums`\) must be a floating-point array"):
        laplacian(mlp, 0)(params, x)
    with pytest.raises(TypeError, match=r"floating-point scalar or array of shape \(d,\), got float32\[1, 2\]"):
        laplacian(mlp, 1)(params, x[None])
    with pytest.raises(TypeError, match=r"floating-point scalar or array of shape \(d,\), got int32\[2\]"):
        laplacian(mlp, 1)(params, jnp.array([1, 2]))
    with pytest.raises(ValueError,
                       match=r"`method`='hvp' must be one of \['collapsed', 'forward', 'reverse', 'taylor'\]"):
        laplacian(mlp, 1, method="hvp")
    with pytest.raises(ValueError, match=r"`indices`=\(0, 2\) must be entries of x in \[0, 2\)"):
        laplacian(mlp, 1, indices=(0, 2))(params, x)
    for bad in ((0, 0), (-1,)):
        with pytest.raises(ValueError, match="`indices`=.*distinct non-negative ints"):
            laplacian(mlp, 1, indices=bad)
    for bad in ((), (0.5,), "0", [[0]], (True,)):
        with pytest.raises((TypeError, ValueError), match="`indices`="):
            laplacian(mlp, 1, indices=bad)
    with pytest.raises(TypeError, match="`of`="):
        laplacian(mlp, 1, of="")


def _eqns(jaxpr):
    return len(jaxpr.eqns) + sum(_eqns(j) for e in jaxpr.eqns for j in jcore.jaxprs_in_params(e.params))


def test_directions_are_one_batch_and_the_first_layer_maps_the_seeds_once():
    """The collapsed Laplacian's program does not grow with d, and under vmap over points the
    seed directions pass the first (linear) layer once: a [d, width] product, not one per point."""
    sizes, firsts = [], []
    for d in (4, 12):
        params = init(d)
        program = jax.make_jaxpr(jax.vmap(laplacian(mlp, 1), (None, 0)))(params, points(d, n=8))
        sizes.append(_eqns(program.jaxpr))
        firsts.append([e for e in program.jaxpr.eqns if e.primitive.name == "dot_general"
                       and sorted(e.outvars[0].aval.shape) == sorted((d, 16))])  # W times the seeds
    assert sizes[0] == sizes[1]
    assert all(len(f) == 1 for f in firsts)


def test_checkpointed_network_is_propagated_collapsed_and_stays_checkpointed():
    """``jax.checkpoint`` around the network: its body is propagated as the collapsed rules do
    (the same equations as without it, inside the checkpoint: not a nested ``jax.jvp`` per
    direction), the checkpoint kept for the weight gradient, the values and gradients the same."""
    d = 3
    params, x = init(d), points(d, n=8)
    lap = lambda f: jax.vmap(laplacian(f, 1), (None, 0))  # noqa: E731
    plain = jax.make_jaxpr(lap(mlp))(params, x).jaxpr
    ckpt = jax.make_jaxpr(lap(jax.checkpoint(mlp)))(params, x).jaxpr
    remats = [e for e in ckpt.eqns if e.primitive.name == "remat2"]
    assert remats and _eqns(ckpt) <= _eqns(plain) + len(remats)
    loss = lambda f: lambda p: jnp.mean(lap(f)(p, x) ** 2)  # noqa: E731
    grad = jax.make_jaxpr(jax.grad(loss(jax.checkpoint(mlp))))(params).jaxpr
    assert any(e.primitive.name == "remat2" for e in grad.eqns)
    with jax.default_matmul_precision("highest"):
        pairs = [(jax.jit(lap(f))(params, x), jax.jit(jax.grad(loss(f)))(params)) for f in (mlp, jax.checkpoint(mlp))]
    for u, v in zip(jax.tree_util.tree_leaves(pairs[0]), jax.tree_util.tree_leaves(pairs[1])):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(u))))


@pytest.mark.slow  # (the fast suite's budget)
def test_a_laplacian_of_a_function_taking_derivatives_is_chains_with_the_collapsed_keys():
    """``laplacian(u_t, x)`` with ``u_t`` a ``jaxamp.grad``: each entry's second derivative is
    the chain ``u_t`` two steps longer (planned with the point's other requests), the value the
    trace of JAX's Hessian, the scaler keys the collapsed Laplacian's (per term: ``u__t`` for the
    first step, ``u__t__lap`` for the second), whether ``x`` has one entry or several."""
    d = 3
    params, x = init(d), points(d, n=8)
    u = lambda p, t, x: mlp(p, x * (1.0 + t))  # noqa: E731
    ts = jnp.linspace(0.1, 0.4, 8)
    u_t = jaxamp.grad(u, 1, of="u", wrt="t")
    lap = jax.vmap(laplacian(u_t, 2), (None, 0, 0))
    assert "jaxamp_chain" in str(jax.make_jaxpr(lap)(params, ts, x))
    want = jax.vmap(trace_hessian(jax.grad(u, 1), 2), (None, 0, 0))(params, ts, x)
    np.testing.assert_allclose(jax.jit(lap)(params, ts, x), want, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))
    term = jaxamp.AmpConfig(mode="per_term_scaler")
    for f, args in ((laplacian(u_t, 2), (params, ts[0], x[0])), (laplacian(u_t, 1), (params, ts[0], x[0]))):
        assert scaler_keys(f, term)(*args) == ("u", "u__t", "u__t__lap")
        assert scaler_keys(f)(*args) == ("1", "2", "3")


def test_the_steps_a_laplacian_adds_to_an_unnamed_derivative_stay_unnamed():
    """``laplacian(jvp(grad_x(u), t), t)``: the chain inside is unnamed, so the steps the
    Laplacian adds carry no name either (a name would fix their order: the plan orders unnamed
    steps as it orders the nested ``grad``s', sharing passes with the point's other requests);
    a named chain's added steps carry the Laplacian's names (its keys: the collapsed ones)."""
    from jaxamp._src.derivatives.chain_call import chain_p

    params = init(2)
    u = lambda p, t, x: mlp(p, jnp.stack([t, x]))  # noqa: E731

    def inner(of):
        d = jaxamp.grad(u, 2, of=of, wrt=None if of is None else "x")
        return lambda p, t, x: jaxamp.jvp(lambda s: d(p, s, x), (t,), (jnp.float32(1.0),))[1]

    for of, want in ((None, {(None, None, None)}), ("u", {("x", "lap", None)})):
        closed = jax.make_jaxpr(laplacian(inner(of), 1))(params, jnp.float32(0.2), jnp.float32(0.3))
        wrts = {link.wrts for e in closed.jaxpr.eqns if e.primitive is chain_p for link in e.params["links"]
                if len(link.argnums) == 4}
        assert wrts == {w[:1] + (None,) + w[1:] for w in want}, wrts
