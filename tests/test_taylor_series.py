"""jaxamp._src.taylor.series: pure derivatives of order K by Taylor mode, one scale per order."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._src import taylor
from jaxamp._src.derivatives import forward_engine as forward
from jaxamp.models import FullyConnected
from jaxamp._src.taylor import faa_di_bruno
from tests.helpers.taylor import FUNCTIONS, STRICT_FP16, fp16_net, nested_series

SCALES = (2.0**-1, 2.0**-3, 0.3, 2.0**-6)  # a non-power of two among them: exact in fp32 anyway


def run(fn, xs, **jit_kw):
    return jax.jit(jax.vmap(fn), **jit_kw)(xs)


@pytest.mark.parametrize("k, bell", [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52), (6, 203)])
def test_partition_coefficients_count_set_partitions(k, bell):
    """Faa di Bruno's coefficients count the set partitions of k things with each block-size
    pattern, so they sum to the Bell number."""
    parts = faa_di_bruno.partitions(k)
    assert all(sum(p) == k and list(p) == sorted(p, reverse=True) for p, _ in parts)
    assert parts[0] == ((k,), 1)
    assert sum(c for _, c in parts) == bell


# fast: order 4 scaled on every function (order 2 is series(order=2) == second_order, which
# test_taylor checks bitwise); the other variants run in the slow run
FAST_FP32 = {(name, 4, True) for name in FUNCTIONS}


@pytest.mark.parametrize("name, order, scaled", [
    case if case in FAST_FP32 else pytest.param(*case, marks=pytest.mark.slow)  # further variants: slow run
    for case in ((name, order, scaled) for order, scaled in [(2, True), (4, False), (4, True)]
                 for name in sorted(FUNCTIONS))
])
def test_fp32_matches_nested_jvp(name, order, scaled):
    f = FUNCTIONS[name]
    xs = jax.random.uniform(jax.random.PRNGKey(1), (8, 2), minval=-1, maxval=1)
    scales = SCALES[:order] if scaled else (1.0,) * order
    e = jnp.array([1.0, 0.0])
    s = [jnp.float32(v) for v in scales] if scaled else None
    with jax.default_matmul_precision("highest"):
        y, got = run(lambda x: taylor.series(f, x, e, order, s), xs)
        ref = run(lambda x: nested_series(f, x, e, scales), xs)
    for g, r in zip([y] + got, ref):
        np.testing.assert_allclose(g, r, rtol=2e-6, atol=2e-6 * float(jnp.abs(r).max() + 1e-30))


@pytest.mark.slow
def test_fp16_values_match_nested_jvp_and_a_large_scale_overflows_its_order():
    """Float16 network, float32 first layer and activations: every order agrees with nested
    jvp to float16 rounding; an order whose scale is too large overflows (to inf in that order
    only), as the DerivScaler needs to see it."""
    f, xs = fp16_net("tanh")
    e = jnp.zeros(2).at[0].set(1.0)
    scales = (2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8)
    # the scales are arguments: one compiled program serves both sets of scales
    ours = jax.jit(lambda s: jax.vmap(lambda x: taylor.series(f, x, e, 4, s))(xs), compiler_options=STRICT_FP16)
    _, got = ours([jnp.float32(s) for s in scales])
    ref = run(lambda x: nested_series(f, x, e, scales), xs, compiler_options=STRICT_FP16)[1:]
    for k, (g, r) in enumerate(zip(got, ref), 1):
        assert bool(jnp.all(jnp.isfinite(r))), k
        np.testing.assert_allclose(g, r, atol=1e-2 * float(jnp.abs(r).max()), err_msg=f"order {k}")
    big = scales[:3] + (2.0**30,)
    _, got = ours([jnp.float32(s) for s in big])
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in got[:3])
    assert not bool(jnp.all(jnp.isfinite(got[3])))


def test_fp16_activations_rescale_the_tangents_before_the_product(monkeypatch):
    """Float16 activations: with S_1 = 2^8 the product of two or three order-1 tangents passes
    65504 while the scaled terms (x S_2 / S_1^2 = 2^-12, x S_3 / S_1^3 = 2^-24) do not: the
    tangents are rescaled before the product (each by 2^-8 here), so the values stay finite
    where nested jvp's do. Scaling after the product (as float32 primitives do) must overflow
    here, or this tests nothing; scaling only the first tangent overflowed at order 3 too."""
    f, xs = fp16_net("tanh", autocast_activation=True)
    e = jnp.zeros(2).at[0].set(1.0)
    scales = (2.0**8, 2.0**4, 2.0**0)

    def ours():
        s = [jnp.float32(v) for v in scales]
        return run(lambda x: taylor.series(f, x, e, 3, s), xs, compiler_options=STRICT_FP16)[1]

    got = ours()
    ref = run(lambda x: nested_series(f, x, e, scales), xs, compiler_options=STRICT_FP16)[1:]
    assert all(bool(jnp.all(jnp.isfinite(r))) for r in ref)
    for k, (g, r) in enumerate(zip(got, ref), 1):
        np.testing.assert_allclose(g, r, atol=2e-2 * float(jnp.abs(r).max()), err_msg=f"order {k}")
    monkeypatch.setattr(faa_di_bruno, "SCALE_AFTER_MIN_BITS", 16)  # float16 counts as wide: scale after
    assert not all(bool(jnp.all(jnp.isfinite(g))) for g in ours()[1:])


def test_bad_arguments_are_rejected():
    f = FUNCTIONS["tanh_mlp"]
    with pytest.raises(ValueError, match="`order`=0"):
        taylor.series(f, jnp.zeros(2), jnp.ones(2), 0)
    with pytest.raises(ValueError, match="2 scales for order 3"):
        taylor.series(f, jnp.zeros(2), jnp.ones(2), 3, [1.0, 1.0])


def _compiled_step(engine, params, pts, scales, names):
    """The jitted weight gradient through ``names`` (values and flags as aux), compiled."""
    def loss(p):
        vals, flags = jaxamp.scaled(engine)(scales, p, pts)
        return sum(jnp.mean(vals[n] ** 2) for n in names), (vals, flags)

    return jax.jit(jax.grad(loss, has_aux=True)).lower(params).compile()


def _flops(compiled):
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


@pytest.mark.slow  # compiles two weight gradients of fourth-order engines
def test_engine_fourth_order_equals_nested_jvp_in_fewer_flops():
    """Derivatives(method="forward") on u__x__x__x__x, u__y__y__y, u__x__y: Taylor mode gives
    nested jvp's values (fp16 rounding, same flags) and the weight gradient costs fewer XLA
    FLOPs (measured 0.72x of nested jvp's on this 2x64 net). Nested jvp is the forward engine
    with the Taylor-mode threshold raised past every order (a point engine passed as method)."""
    amp = jaxamp.AmpConfig(dtype="float16")
    names = ("u__x__x__x__x", "u__y__y__y", "u__x__y")
    net = FullyConnected.from_amp(amp, out_features=1, layer_size=64, nr_layers=2)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros(2))
    kw = dict(inputs=("x", "y"), outputs=("u",), derivatives=names, amp=amp)
    engine = jaxamp.Derivatives(lambda p, x: net.apply(p, x), **kw)
    nested = jaxamp.Derivatives(lambda p, x: net.apply(p, x), **kw,
                                method=functools.partial(forward.point_values, series_min_order=99))
    pts = jax.random.uniform(jax.random.PRNGKey(1), (64, 2))
    scales = {k: jnp.float32(2.0 ** -(i + 1)) for i, k in enumerate(engine.scaler_keys)}
    series = _compiled_step(engine, params, pts, scales, names)
    nested_step = _compiled_step(nested, params, pts, scales, names)
    _, (got, flags) = series(params)
    _, (ref, ref_flags) = nested_step(params)
    assert {k: bool(v) for k, v in flags.items()} == {k: bool(v) for k, v in ref_flags.items()}
    for n in ref:
        np.testing.assert_allclose(got[n], ref[n], atol=1e-2 * float(jnp.abs(ref[n]).max()), err_msg=n)
    assert _flops(series) < 0.8 * _flops(nested_step), (_flops(series), _flops(nested_step))


@pytest.mark.parametrize("scaled", [False, True])
def test_float64_keeps_float64_precision(scaled):
    """Under x64, every order of a float64 series equals nested jax.grad to float64 rounding:
    no coefficient, seed or Faa di Bruno factor passes through float32."""
    with jax.enable_x64(True):
        f = lambda x: jnp.sin(3.0 * x) * jnp.exp(x) + 0.1 / (1.1 + x)  # noqa: E731
        x, order = jnp.float64(0.3), 5
        scales = [jnp.float32(2.0**-3)] * order if scaled else None
        y, got = taylor.series(f, x, jnp.float64(1.0), order, scales)
        ref, g = [], f
        for _ in range(order):
            g = jax.grad(g)
            ref.append(g(x))
        assert y.dtype == jnp.float64 and all(d.dtype == jnp.float64 for d in got)
        unscaled = [d / (2.0**-3 if scaled else 1.0) for d in got]
        np.testing.assert_allclose(unscaled, ref, rtol=1e-12)


def _count(jaxpr, name: str) -> int:
    return sum((e.primitive.name == name) + sum(_count(s, name) for s in jax.extend.core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def test_a_point_built_with_stack_carries_no_higher_coefficients_into_the_first_layer():
    """``jnp.stack([a, b])`` is linear and b's orders 2..K are zero, so the first layer multiplies
    the value and order 1 only (2 matmuls at any K), as for a point given as a vector; the
    coefficients equal nested jvp's."""
    w = jax.random.normal(jax.random.PRNGKey(3), (2, 8))
    f = lambda b: jnp.sum(jnp.tanh(jnp.stack([jnp.float32(0.3), b]) @ w) ** 2)  # noqa: E731
    y, ds = taylor.series(f, jnp.float32(0.5), jnp.float32(1.0), 4)
    assert _count(jax.make_jaxpr(lambda b: taylor.series(f, b, jnp.float32(1.0), 4))(0.5).jaxpr, "dot_general") == 2
    want = f
    for k, d in enumerate(ds):
        want = jax.grad(want)
        np.testing.assert_allclose(d, want(jnp.float32(0.5)), rtol=2e-5, atol=1e-5)


def test_nested_grad_of_a_stacked_point_multiplies_the_first_layer_as_the_engine_does():
    """Four nested ``jaxamp.grad`` along one scalar of a point the network stacks: jaxamp's marks
    (the variable's, the scales') pass zero coefficients as zero, so the first layer takes the
    value and order 1 only, and the value equals JAX's own."""
    w = jax.random.normal(jax.random.PRNGKey(4), (2, 8))
    u = lambda w, a, b: jnp.sum(jnp.tanh(jnp.stack([a, b]) @ w))  # noqa: E731
    top = jaxamp.grad(jaxamp.grad(jaxamp.grad(jaxamp.grad(u, 2), 2), 2), 2)
    scaled, scales = jaxamp.scaled(top, jaxamp.AmpConfig()), {k: jnp.float32(1.0) for k in "1234"}
    jaxpr = jax.make_jaxpr(lambda w: scaled(scales, w, 0.3, 0.5))(w).jaxpr
    first_layer = [e for e in _all_eqns(jaxpr)
                   if e.primitive.name == "dot_general" and e.invars[1].aval.shape == (2, 8)]
    assert len(first_layer) == 2
    want = jax.grad(jax.grad(jax.grad(jax.grad(u, 2), 2), 2), 2)(w, 0.3, 0.5)
    np.testing.assert_allclose(scaled(scales, w, 0.3, 0.5)[0], want, rtol=1e-4)


def _all_eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for s in jax.extend.core.jaxprs_in_params(e.params):
            yield from _all_eqns(s)
