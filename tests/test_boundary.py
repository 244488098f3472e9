"""The network boundary (jaxamp._src.core.boundary): JAX's own derivatives of an autocast network
are scaled per order and checked, whoever takes them.

Overflow tests compile with ``xla_allow_excess_precision=False`` (float16 ops round to float16:
the CPU would otherwise keep float32 inside fusions) and the unscaled run must overflow.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

STRICT_FP16 = {"xla_allow_excess_precision": False}
AMP = jaxamp.AmpConfig(autocast_firstlayer=True)
MODEL = nn.Sequential([nn.Dense(16), jnp.tanh, nn.Dense(16), jnp.tanh, nn.Dense(1)])


def _params(gain=1.0):
    p = MODEL.init(jax.random.PRNGKey(0), jnp.zeros(2))
    return jax.tree_util.tree_map_with_path(
        lambda path, v: (v * gain if "layers_0" in jax.tree_util.keystr(path)
                         and "kernel" in jax.tree_util.keystr(path) else v), p)


def _u(amp):
    net = jaxamp.autocast(MODEL.apply, amp)
    return lambda p, x: net(p, x)[0]


def _laplacian_jvp(f):  # sum of second directional derivatives, built from jax.jvp
    def lap(p, x):
        def d2(e):
            return jax.jvp(lambda y: jax.jvp(lambda z: f(p, z), (y,), (e,))[1], (x,), (e,))[1]
        return sum(d2(e) for e in jnp.eye(x.shape[0]))
    return lap


FORMS = {
    "hessian": lambda f: lambda p, x: jnp.trace(jax.hessian(f, 1)(p, x)),
    "jacfwd(jacrev)": lambda f: lambda p, x: jnp.trace(jax.jacfwd(jax.jacrev(f, 1), 1)(p, x)),
    "jacrev(jacrev)": lambda f: lambda p, x: jnp.trace(jax.jacrev(jax.jacrev(f, 1), 1)(p, x)),
    "jvp laplacian": _laplacian_jvp,
    "grad(grad) of x0": lambda f: lambda p, x: jax.grad(lambda t: jax.grad(lambda s: f(p, x.at[0].set(s)))(t))(x[0]),
}
X = jnp.stack([jnp.linspace(-0.02, 0.02, 8), jnp.linspace(0.01, -0.01, 8)], axis=1)


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_is_scaled_per_order_and_matches_float32(form):
    d16, d32 = FORMS[form](_u(AMP)), FORMS[form](_u(None))
    fn = jax.vmap(d16, (None, 0))
    assert (jaxamp.init(lambda p, x: jnp.sum(fn(p, x)), AMP, from_profile=False)(_params(), X).scales.keys()
            == {"1", "2"})
    vals, found = jax.jit(jaxamp.scaled(fn, AMP))({"1": 2.0**-2, "2": 2.0**-5}, _params(), X)
    assert sorted(found) == ["1", "2", "nonfinite_values"] and not any(bool(v) for v in found.values())
    with jax.default_matmul_precision("highest"):
        ref = jax.vmap(d32, (None, 0))(_params(), X)
    np.testing.assert_allclose(vals, ref, atol=2e-2 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("form", list(FORMS))
def test_a_forced_second_order_overflow_flags_key_2_only_and_backs_off(form):
    params = _params(gain=400.0)  # |u_xx| ~ 1e5: the second order overflows float16, the first does not
    fn = jax.vmap(FORMS[form](_u(AMP)), (None, 0))
    with jax.default_matmul_precision("highest"):
        ref = jax.vmap(FORMS[form](_u(None)), (None, 0))(params, X)
    assert float(jnp.abs(ref).max()) > 65504
    call = jax.jit(jaxamp.scaled(fn, AMP), compiler_options=STRICT_FP16)
    _, found = call({"1": 1.0, "2": 1.0}, params, X)
    assert bool(found["2"]) and not bool(found["1"]) and not bool(found["nonfinite_values"])
    vals, found = call({"1": 1.0, "2": 2.0**-6}, params, X)
    assert not any(bool(v) for v in found.values())
    np.testing.assert_allclose(vals, ref, atol=2e-2 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("form", ["hessian", "jvp laplacian"])
def test_a_derivative_nobody_reads_is_not_checked(form):
    """An overflowing second order the function computes but does not return flags nothing (it
    cannot make a result wrong) and is not in the program; returned, it flags key 2."""
    params = _params(gain=400.0)  # |u_xx| ~ 1e5 overflows float16 at scale 1 (the test above)
    u, d2 = _u(AMP), FORMS[form](_u(AMP))

    def unread(p, x):
        lap = d2(p, x)  # noqa: F841 -- computed, never read
        return u(p, x)

    def read(p, x):
        return u(p, x) + 0.0 * d2(p, x)

    for fn, flagged in ((unread, False), (read, True)):
        call = jax.jit(jaxamp.scaled(jax.vmap(fn, (None, 0)), AMP), compiler_options=STRICT_FP16)
        vals, found = call({"1": 1.0, "2": 1.0}, params, X)
        assert bool(found.get("2", False)) is flagged and not bool(found.get("nonfinite_values", False))
        if not flagged:
            np.testing.assert_array_equal(np.asarray(vals), np.asarray(jax.jit(jax.vmap(u, (None, 0)))(params, X)))
            dots = [str(jax.make_jaxpr(jaxamp.scaled(jax.vmap(g, (None, 0)), AMP))({"1": 1.0, "2": 1.0}, params, X))
                    .count("dot_general") for g in (fn, u)]
            assert dots[0] == dots[1]  # the unread derivative's passes are gone from the program


@pytest.mark.parametrize("form", list(FORMS))
def test_an_overflow_below_the_returned_derivative_is_flagged(form):
    """Only the second derivative is returned, but it is computed from the first's scaled float16
    values: a first order that overflows (its seed, 2**17, is past float16's range) flags key 1,
    though nothing reads the first derivative itself."""
    fn = jax.vmap(FORMS[form](_u(AMP)), (None, 0))
    call = jax.jit(jaxamp.scaled(fn, AMP), compiler_options=STRICT_FP16)
    vals, found = call({"1": 2.0**17, "2": 1.0}, _params(), X)
    assert bool(found["1"]) and not bool(found["nonfinite_values"])
    assert not np.all(np.isfinite(np.asarray(vals)))  # the result it guards is wrong
    _, found = call({"1": 2.0**-2, "2": 1.0}, _params(), X)
    assert not any(bool(v) for v in found.values())


def test_fourth_order_and_scale_invariance_bit_for_bit():
    """Binary scales commute with rounding: any power-of-two scales give the same bits."""
    u = _u(AMP)
    d4 = jax.grad(jax.grad(jax.grad(jax.grad(lambda p, s: u(p, jnp.stack([s, 0.0])), 1), 1), 1), 1)
    fn = jax.vmap(d4, (None, 0))
    call = jax.jit(jaxamp.scaled(fn, AMP), compiler_options=STRICT_FP16)
    one, found = call({k: 1.0 for k in "1234"}, _params(), X[:, 0])
    assert sorted(found) == ["1", "2", "3", "4", "nonfinite_values"]
    other, _ = call({"1": 2.0**-1, "2": 2.0**-3, "3": 2.0**-4, "4": 2.0**-7}, _params(), X[:, 0])
    np.testing.assert_array_equal(np.asarray(one), np.asarray(other))


def test_weight_gradients_stay_the_loss_scalers():
    """A parameter derivative of the network writes no derivative key; outside jaxamp it runs."""
    u = _u(AMP)
    loss = lambda p, x: jnp.mean(jax.vmap(u, (None, 0))(p, x) ** 2)
    assert not jaxamp.init(loss, AMP, from_profile=False)(_params(), X).scales
    g = jax.jit(jax.grad(loss))(_params(), X)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(g))


def test_an_input_derivative_outside_jaxamp_warns_naming_the_fix():
    u_xx = FORMS["hessian"](_u(AMP))
    with pytest.warns(jaxamp.UnscaledDerivativeWarning, match=r"jaxamp.scaled\(fn\)\(amp_state"):
        jax.jit(u_xx)(_params(), X[0])
    state = jaxamp.init(u_xx, AMP, from_profile=False)(_params(), X[0])
    value, _ = jaxamp.scaled(u_xx)(state, _params(), X[0])  # the fix: under the state's scales
    assert bool(jnp.isfinite(value))


def test_equinox_module_and_plain_function_are_scaled_too():
    mlp = eqx.nn.MLP(2, "scalar", 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(1))
    f = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) @ p["v"])
    pf = {"w": jnp.ones((2, 8)) * 0.3, "v": jnp.ones((8,)) * 0.2}
    for net, args in [(jaxamp.autocast(mlp, AMP), ()), (jaxamp.autocast(f, AMP), (pf,))]:
        u = (lambda x: net(x)) if not args else (lambda x: net(*args, x))
        lap = lambda x: jnp.trace(jax.hessian(u)(x))
        state = jaxamp.init(lambda x: lap(x), AMP, from_profile=False)(X[0])
        assert sorted(state.scales) == ["1", "2"]
        value, found = jaxamp.scaled(lap)(state, X[0])
        assert bool(jnp.isfinite(value)) and not bool(found["2"])


@pytest.mark.slow  # trains both ports: the scaled derivatives they rest on are tested fast here
def test_jax_grad_loss_trains_as_the_jaxamp_grad_port():
    """The README's Poisson with its jax.grad kept: same keys, scales and skips as jaxamp.grad."""
    model = nn.Sequential([nn.Dense(16), jnp.tanh, nn.Dense(16), jnp.tanh, nn.Dense(1)])
    params0 = model.init(jax.random.PRNGKey(0), jnp.zeros(1))
    amp = jaxamp.AmpConfig()

    def run(grad):
        u = lambda p, x: jaxamp.autocast(model.apply, amp)(p, x[None])[0]
        u_xx = grad(grad(u, 1), 1)
        loss = lambda p, x: jnp.mean((jax.vmap(u_xx, (None, 0))(p, x) + jnp.pi**2 * jnp.sin(jnp.pi * x)) ** 2)
        xs = jnp.linspace(0.0, 1.0, 32)
        opt = jaxamp.optimizer(optax.adam(1e-3), amp_state=jaxamp.init(loss, amp)(params0, xs))

        @jax.jit
        def step(p, s):
            l, g, flags = jaxamp.value_and_grad(loss)(s, p, xs)
            up, s = opt.update(g, s, p, flags=flags)
            return optax.apply_updates(p, up), s, l

        p, s, out = params0, opt.init(params0), []
        for _ in range(30):
            p, s, l = step(p, s)
            out.append(float(l))
        return out, s

    (l_jax, s_jax), (l_amp, s_amp) = run(jax.grad), run(jaxamp.grad)
    assert jax.tree_util.tree_structure(s_jax.amp.scales) == jax.tree_util.tree_structure(s_amp.amp.scales)
    assert {k: float(v) for k, v in s_jax.amp.scales.items()} == {k: float(v) for k, v in s_amp.amp.scales.items()}
    np.testing.assert_allclose(l_jax, l_amp, rtol=1e-2)


def _kinds():
    """The same kind of network four ways, its first layer's weights large (|u_xx| ~ 1e5):
    ``{kind: u(x) for x in R^2}`` under autocast(AMP) and the float32 original."""
    from flax import nnx

    linen = _params(gain=400.0)
    eqx_net = eqx.nn.MLP(2, "scalar", 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    eqx_net = eqx.tree_at(lambda m: m.layers[0].weight, eqx_net, eqx_net.layers[0].weight * 1000.0)

    class NNXNet(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.a, self.b = nnx.Linear(2, 16, rngs=rngs), nnx.Linear(16, 16, rngs=rngs)
            self.c = nnx.Linear(16, 1, rngs=rngs)
            self.a.kernel[...] = self.a.kernel[...] * 400.0

        def __call__(self, x):
            return self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))[0]

    nnx_net = NNXNet()
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    w = {"w": jax.random.normal(keys[0], (2, 16)) * 400.0, "v": jax.random.normal(keys[1], (16, 16)),
         "o": jax.random.normal(keys[2], (16,)) * 0.3}
    plain = lambda p, x: jnp.tanh(jnp.tanh(x @ p["w"]) @ p["v"]) @ p["o"]  # noqa: E731
    placed_linen, placed_plain = jaxamp.autocast(MODEL.apply, AMP), jaxamp.autocast(plain, AMP)
    return {
        "flax linen": (lambda x: placed_linen(linen, x)[0], lambda x: MODEL.apply(linen, x)[0]),
        "flax nnx": (jaxamp.autocast(nnx_net, AMP), nnx_net),
        "equinox": (jaxamp.autocast(eqx_net, AMP), eqx_net),
        "plain function": (lambda x: placed_plain(w, x), lambda x: plain(w, x)),
    }


@pytest.mark.parametrize("kind", ["flax linen", "flax nnx", "equinox", "plain function"])
def test_each_kind_of_network_overflows_its_second_order_key_alone_under_jax_hessian(kind):
    """jax.hessian of an autocast network, whatever holds it: the forced second-order overflow is
    flagged under key "2" alone (the step skips and that key backs off) and a lower scale cures it."""
    u16, u32 = _kinds()[kind]
    lap = lambda u: jax.vmap(lambda x: jnp.trace(jax.hessian(u)(x)))  # noqa: E731
    with jax.default_matmul_precision("highest"):
        ref = lap(u32)(X)
    assert float(jnp.abs(ref).max()) > 65504, kind
    call = jax.jit(jaxamp.scaled(lap(u16), AMP), compiler_options=STRICT_FP16)
    _, found = call({"1": 1.0, "2": 1.0}, X)
    assert bool(found["2"]) and not bool(found["1"]) and not bool(found["nonfinite_values"]), kind
    vals, found = call({"1": 1.0, "2": 2.0**-6}, X)
    assert not any(bool(v) for v in found.values()), kind
    np.testing.assert_allclose(vals, ref, atol=2e-2 * float(jnp.abs(ref).max()))
