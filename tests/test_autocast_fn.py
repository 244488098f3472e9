"""jaxamp.autocast: precision placement for a user's own JAX network, by rewriting its jaxpr.

Bitwise comparisons with FullyConnected/FourierNet run eagerly (op by op), so XLA CPU's excess
precision inside fusions does not enter; the two programs then round at the same points.
"""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jaxamp
import jax.extend
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp import AmpConfig
from jaxamp._src.placement.rewrite import autocast
from jaxamp.models import FourierNet, FullyConnected
from jaxamp._src.models.fourier_net import fourier_matrix

FREQS = ("axis", (0.0, 1.0, 2.0))
WIDTH, DEPTH, N_OUT = 16, 3, 2
F16, F32 = jnp.dtype("float16"), jnp.dtype("float32")


class UserMLP(nn.Module):
    """A JAX user's network: optional fixed Fourier features, nn.Dense with the default dtype."""

    fourier: bool = True
    dense_dtype: Any = None
    act: Callable = jnp.tanh

    @nn.compact
    def __call__(self, x):
        if self.fourier:
            freqs = jnp.asarray(fourier_matrix(x.shape[-1], FREQS))
            phase = 2.0 * jnp.pi * jnp.matmul(x, freqs, precision=jax.lax.Precision.HIGHEST)
            x = jnp.concatenate([x, jnp.sin(phase), jnp.cos(phase)], axis=-1)
        for i in range(DEPTH):
            x = self.act(nn.Dense(WIDTH, dtype=self.dense_dtype, name=f"layers_{i}")(x))
        return nn.Dense(N_OUT, dtype=self.dense_dtype, name="final_layer")(x)


def reference(amp, fourier):
    kw = dict(layer_size=WIDTH, nr_layers=DEPTH, weight_norm=False, activation="tanh")
    if fourier:
        return FourierNet.from_amp(amp, N_OUT, frequencies=FREQS, **kw)
    return FullyConnected.from_amp(amp, N_OUT, **kw)


@functools.lru_cache(maxsize=None)
def user_params(fourier, zero_bias=True, seed=0):
    params = jax.jit(UserMLP(fourier).init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2)))
    if not zero_bias:  # Flax initialises biases to zero; give them values
        keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 16))
        params = jax.tree_util.tree_map_with_path(
            lambda path, p: 0.5 * jax.random.normal(next(keys), p.shape) if "bias" in str(path) else p, params
        )
    return params


def points(n=32, seed=2):
    return jax.random.uniform(jax.random.PRNGKey(seed), (n, 2), minval=-1.0, maxval=1.0)


def walk(jaxpr, name):
    """The operand dtypes of every ``name`` equation, sub-jaxprs included, in program order."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == name:
            found.append(tuple(v.aval.dtype for v in e.invars))
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            found += walk(sub, name)
    return found


FLAGS = [(False, False), (True, False), (False, True), (True, True)]


def amp_of(firstlayer=False, activation=False, dtype="float16"):
    return AmpConfig(dtype=dtype, autocast_firstlayer=firstlayer, autocast_activation=activation)


SLOW = pytest.mark.slow  # further variants of a property that a fast variant checks


@pytest.mark.parametrize("dtype, dense_dtype", [
    ("float16", None), ("bfloat16", jnp.float32),
    pytest.param("bfloat16", None, marks=SLOW), pytest.param("float16", jnp.float32, marks=SLOW),
])
def test_dots_in_compute_dtype_except_features_and_first_layer(dtype, dense_dtype):
    model, params, x = UserMLP(True, dense_dtype), user_params(True), points()
    plain = walk(jax.make_jaxpr(model.apply)(params, x).jaxpr, "dot_general")
    assert all(d == (F32, F32) for d in plain)  # the trap: nothing in fp16 without autocast
    jaxpr = jax.make_jaxpr(autocast(model.apply, amp_of(dtype=dtype)))(params, x).jaxpr
    low = jnp.dtype(dtype)
    # Fourier features x @ F (no parameter), first layer, then DEPTH - 1 hidden + final in fp16.
    assert walk(jaxpr, "dot_general") == [(F32, F32)] * 2 + [(low, low)] * DEPTH
    assert walk(jaxpr, "tanh") == [(F32,)] * DEPTH
    assert walk(jaxpr, "sin") == walk(jaxpr, "cos") == [(F32,)]
    assert jaxpr.outvars[0].aval.dtype == F32
    hlo = jax.jit(autocast(model.apply, amp_of(dtype=dtype))).lower(params, x).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == DEPTH + 2 and sum(f"x{low.name.replace('float', 'f')}>" in d for d in dots) == DEPTH


def test_casting_only_the_input_stays_fp32_but_autocast_moves_the_dots():
    """The trap: Flax's nn.Dense(dtype=None) promotes a float16 input back to float32."""
    model, params, x = UserMLP(False), user_params(False), points()

    def cast_input(params, x):
        return model.apply(params, x.astype(jnp.float16))

    assert walk(jax.make_jaxpr(cast_input)(params, x).jaxpr, "dot_general") == [(F32, F32)] * (DEPTH + 1)
    jaxpr = jax.make_jaxpr(autocast(cast_input, AmpConfig()))(params, x).jaxpr
    assert walk(jaxpr, "dot_general") == [(F32, F32)] + [(F16, F16)] * DEPTH


@pytest.mark.parametrize("firstlayer,activation", FLAGS)
def test_flags_change_placement(firstlayer, activation):
    model, params, x = UserMLP(False), user_params(False), points()
    jaxpr = jax.make_jaxpr(autocast(model.apply, amp_of(firstlayer, activation)))(params, x).jaxpr
    first = (F16, F16) if firstlayer else (F32, F32)
    assert walk(jaxpr, "dot_general") == [first] + [(F16, F16)] * DEPTH
    first_act = (F16,) if firstlayer and activation else (F32,)
    assert walk(jaxpr, "tanh") == [first_act] + [(F16,) if activation else (F32,)] * (DEPTH - 1)


BITWISE_FAST = [(False, *FLAGS[0], "float16"), (True, *FLAGS[3], "float16"), (True, *FLAGS[0], "bfloat16")]
BITWISE = [(f, *flags, "float16") for f in (False, True) for flags in FLAGS] + [
    (True, *flags, "bfloat16") for flags in (FLAGS[0], FLAGS[3])]


@pytest.mark.parametrize(
    "fourier,firstlayer,activation,dtype",
    [case if case in BITWISE_FAST else pytest.param(*case, marks=SLOW) for case in BITWISE],
)
def test_bitwise_equal_to_jaxamp_models_with_zero_biases(fourier, firstlayer, activation, dtype):
    """Same weights, Flax's zero biases: FullyConnected adds its bias in the compute dtype, the
    user's network in float32; with zero biases both adds are exact, every other op rounds at the
    same point, so the outputs are bitwise equal."""
    amp = amp_of(firstlayer, activation, dtype)
    params, x = user_params(fourier), points()
    ref_params = {"params": {"fc": params["params"]}} if fourier else params
    expected = reference(amp, fourier).apply(ref_params, x)
    got = autocast(UserMLP(fourier).apply, amp)(params, x)
    assert got.dtype == expected.dtype == F32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    fp32 = UserMLP(fourier).apply(params, x)
    assert not np.array_equal(np.asarray(fp32), np.asarray(expected))  # the placement shows


def test_equal_to_fp16_rounding_with_biases():
    """With nonzero biases the only difference left is the rounding of FullyConnected's fp16 bias
    add (autocast keeps every non-matmul op as written, in float32): half an fp16 ulp of each
    pre-activation, propagated through the layers."""
    amp = amp_of()
    params, x = user_params(True, zero_bias=False), points()
    expected = reference(amp, True).apply({"params": {"fc": params["params"]}}, x)
    got = autocast(UserMLP(True).apply, amp)(params, x)
    fp32 = UserMLP(True).apply(params, x)
    scale = float(jnp.max(jnp.abs(fp32)))
    assert float(jnp.max(jnp.abs(got - expected))) <= 2.0 ** -8 * scale
    assert not np.array_equal(np.asarray(got), np.asarray(fp32))


def test_disabled_or_float32_is_fn_itself():
    fn = UserMLP().apply
    for amp in (None, AmpConfig(enabled=False), AmpConfig(dtype="float32")):
        assert autocast(fn, amp) is fn


def test_nothing_in_compute_dtype_is_an_error_naming_fn():
    def no_matmul(params, x):
        return jnp.tanh(x * params)

    with pytest.raises(ValueError, match="no_matmul.*none"):
        autocast(no_matmul, AmpConfig())(2.0, points())

    one_layer = nn.Dense(1)
    params = one_layer.init(jax.random.PRNGKey(0), points())
    with pytest.raises(ValueError, match=r"Dense\.apply.*1 first layer.*autocast_firstlayer"):
        autocast(one_layer.apply, AmpConfig())(params, points())
    out = autocast(one_layer.apply, AmpConfig(autocast_firstlayer=True))(params, points())
    assert out.dtype == F32


def test_params_argnums_names_the_parameters():
    model, params, x = UserMLP(False), user_params(False), points()
    expected = autocast(model.apply, AmpConfig())(params, x)

    def x_first(x, params):
        return model.apply(params, x)

    np.testing.assert_array_equal(autocast(x_first, AmpConfig(), params_argnums=1)(x, params), expected)
    with pytest.raises(ValueError, match=r"x_first.*4 without a parameter.*params_argnums=\(\)"):
        autocast(x_first, AmpConfig(), params_argnums=())(x, params)

    def closure(x):  # parameters captured: with params_argnums=() they are the captured arrays
        return model.apply(params, x)

    np.testing.assert_array_equal(autocast(closure, AmpConfig(), params_argnums=())(x), expected)


@pytest.mark.parametrize("bad", [-1, "0", 1.0, [0, None]])
def test_bad_arguments_are_named(bad):
    with pytest.raises(ValueError, match="params_argnums"):
        autocast(UserMLP().apply, AmpConfig(), params_argnums=bad)
    with pytest.raises(TypeError, match="`amp`"):
        autocast(UserMLP().apply, {"dtype": "float16"})
    with pytest.raises(TypeError, match="`fn`"):
        autocast(None, AmpConfig())
    with pytest.raises(ValueError, match=r"params_argnums`=2 names an argument beyond the 2"):
        autocast(UserMLP().apply, AmpConfig(), params_argnums=2)(user_params(True), points())


@pytest.mark.parametrize("act", [pytest.param(jnp.tanh, marks=SLOW), jax.nn.relu, pytest.param(jax.nn.silu, marks=SLOW),
                                 pytest.param(jax.nn.gelu, marks=SLOW)])
def test_derivatives_wrt_params_and_inputs(act):
    """u(params, t, x) scalar: jax.grad w.r.t. params, nested input derivatives of order 2 under
    vmap, jacrev; finite and close to the float32 network's."""
    model = UserMLP(True, act=act)
    params = user_params(True, zero_bias=False)

    def u_net(params, t, x):
        return model.apply(params, jnp.stack([t, x]))[0]

    ts, xs = points(8)[:, 0], points(8, seed=3)[:, 1]
    def derivatives(u, params):
        u_xx = jax.vmap(jax.grad(jax.grad(u, argnums=2), argnums=2), (None, 0, 0))(params, ts, xs)
        u_tx = jax.vmap(jax.grad(jax.grad(u, argnums=1), argnums=2), (None, 0, 0))(params, ts, xs)
        loss = lambda p: jnp.mean(jax.vmap(u, (None, 0, 0))(p, ts, xs) ** 2)
        g = jax.flatten_util.ravel_pytree(jax.grad(loss)(params))[0]
        jac = jax.jacrev(lambda x: jax.vmap(u, (None, 0, 0))(params, ts, x))(xs)
        return u_xx, u_tx, g, jac

    amp = AmpConfig()  # the input derivatives of the float16 network run under the state's scales (1 here)
    scaled = jaxamp.scaled(lambda p: derivatives(autocast(u_net, amp), p), amp)
    results = [jax.jit(derivatives, static_argnums=0)(u_net, params),
               jax.jit(lambda p: scaled({"1": 1.0, "2": 1.0}, p)[0])(params)]
    for ref, got in zip(*results):
        assert got.dtype == F32 and bool(jnp.all(jnp.isfinite(got)))
        tol = 0.02 * float(jnp.max(jnp.abs(ref))) + 1e-6
        assert float(jnp.max(jnp.abs(got - ref))) <= tol
    assert not np.array_equal(np.asarray(results[0][2]), np.asarray(results[1][2]))


def test_derivative_programs_run_the_dots_in_fp16():
    model, params = UserMLP(False), user_params(False)
    u = autocast(lambda p, x: model.apply(p, x)[0], AmpConfig())
    jaxpr = jax.make_jaxpr(jax.grad(jax.grad(lambda p, s: u(p, jnp.stack([s, s])), 1), 1))(params, 0.5).jaxpr
    dots = walk(jaxpr, "dot_general")
    assert len(dots) > 2 * (DEPTH + 1) and sum(d == (F16, F16) for d in dots) >= 3 * DEPTH


def test_jit_traces_once_and_eager_calls_are_cached():
    model, params = UserMLP(False), user_params(False)
    traces = []

    def fn(params, x):
        traces.append(1)
        return model.apply(params, x)

    wrapped = autocast(fn, AmpConfig())
    jitted = jax.jit(wrapped)
    outs = [jitted(params, points(seed=s)) for s in range(3)]
    assert len(traces) == 1
    for s, out in enumerate(outs):  # jit may keep excess precision: equal up to fp16 rounding
        eager = wrapped(params, points(seed=s))
        assert float(jnp.max(jnp.abs(out - eager))) <= 2.0 ** -8 * float(jnp.max(jnp.abs(eager)))
    assert len(traces) == 1  # eager call: the jaxpr for these shapes is reused
    wrapped(params, points(n=5))
    assert len(traces) == 2  # new shapes: traced again


def test_inlines_jit_and_custom_vjp_bodies_and_keeps_relu_rule():
    dense = nn.Dense(8)
    params = {"a": dense.init(jax.random.PRNGKey(0), jnp.zeros((1, 2))),
              "b": nn.Dense(8).init(jax.random.PRNGKey(1), jnp.zeros((1, 8)))}

    @jax.custom_vjp
    def layer(p, h):
        return nn.Dense(8).apply(p, h)

    layer.defvjp(lambda p, h: (layer(p, h), (p, h)),
                 lambda res, g: jax.vjp(lambda p, h: nn.Dense(8).apply(p, h), *res)[1](g))

    @jax.jit
    def fn(params, x):
        return layer(params["b"], jax.nn.relu(dense.apply(params["a"], x)))

    wrapped = autocast(fn, AmpConfig())
    jaxpr = jax.make_jaxpr(wrapped)(params, points()).jaxpr
    assert walk(jaxpr, "dot_general") == [(F32, F32), (F16, F16)]
    [net] = [e for e in jaxpr.eqns if e.primitive.name == "jaxamp_boundary"]  # the placed network, one equation
    assert [e.primitive.name for e in net.params["jaxpr"].jaxpr.eqns].count("custom_jvp_call") == 1  # relu as written
    g = jax.grad(lambda p: jnp.sum(wrapped(p, points())))(params)
    assert all(bool(jnp.all(jnp.isfinite(l))) for l in jax.tree_util.tree_leaves(g))


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_convolutions():
    class ConvNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jnp.tanh(nn.Conv(4, (3,))(x))
            return nn.Conv(1, (3,))(jnp.tanh(nn.Conv(4, (3,))(x)))

    model = ConvNet()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 10, 1))
    params = jax.jit(model.init)(jax.random.PRNGKey(1), x)
    jaxpr = jax.make_jaxpr(autocast(model.apply, AmpConfig()))(params, x).jaxpr
    assert walk(jaxpr, "conv_general_dilated") == [(F32, F32), (F16, F16), (F16, F16)]


@pytest.mark.slow
def test_checkpoint_cond_scan_and_while_bodies_are_rewritten():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w0": jax.random.normal(keys[0], (2, 8)), "ws": 0.3 * jax.random.normal(keys[1], (3, 8, 8)),
              "w1": jax.random.normal(keys[2], (8, 1))}

    def net(params, x, loop=True):
        ws = params["ws"]
        h = jnp.tanh(x @ params["w0"])  # the first layer
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)
        h = jax.checkpoint(lambda h: jnp.tanh(h @ ws[0]))(h)
        h = jax.lax.cond(x[0, 0] > 0, lambda h: h @ ws[1], lambda h: -h, h)
        if loop:
            h = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.tanh(c[1] @ ws[2])), (0, h))[1]
        return h @ params["w1"]

    x = points(4)
    wrapped = autocast(net, AmpConfig())
    jaxpr = jax.make_jaxpr(wrapped)(params, x).jaxpr
    assert walk(jaxpr, "dot_general") == [(F32, F32)] + [(F16, F16)] * 5
    assert walk(jaxpr, "tanh") == [(F32,)] * 4
    assert [walk(jaxpr, p) != [] for p in ("scan", "remat2", "cond", "while")] == [True] * 4
    out, ref = jax.jit(wrapped)(params, x), jax.jit(net)(params, x)
    assert out.dtype == F32 and float(jnp.max(jnp.abs(out - ref))) <= 0.02 * float(jnp.max(jnp.abs(ref)))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(autocast(net, AmpConfig())(p, x, loop=False) ** 2)))(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    _, tangent = jax.jit(lambda x: jax.jvp(lambda x: wrapped(params, x), (x,), (jnp.ones_like(x),)))(x)
    assert bool(jnp.all(jnp.isfinite(tangent)))


def test_static_arguments_and_pytree_outputs():
    model, params, x = UserMLP(False), user_params(False), points()

    def fn(params, x, double=False, name="u"):
        out = model.apply(params, x)
        return {name: 2.0 * out if double else out}

    wrapped = autocast(fn, AmpConfig())
    plain = wrapped(params, x)["u"]
    np.testing.assert_array_equal(wrapped(params, x, double=True, name="v")["v"], 2.0 * plain)
    np.testing.assert_array_equal(plain, autocast(model.apply, AmpConfig())(params, x))


def test_matmuls_left_inside_other_primitives_warn():
    @jax.custom_batching.custom_vmap
    def layer(w, h):
        return h @ w

    layer.def_vmap(lambda axis_size, in_batched, w, h: (h @ w, in_batched[1]))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = [jax.random.normal(keys[0], (2, 8)), jax.random.normal(keys[1], (8, 8)),
              jax.random.normal(keys[2], (8, 1))]

    def three_layers(params, x):
        h = jnp.tanh(jnp.tanh(x @ params[0]) @ params[1])
        return layer(params[2], h)

    with pytest.warns(UserWarning, match=r"three_layers.*1 inside custom_vmap_call \(left as written\)"):
        jaxpr = jax.make_jaxpr(autocast(three_layers, AmpConfig()))(params, points()).jaxpr
    assert walk(jaxpr, "dot_general") == [(F32, F32), (F16, F16), (F32, F32)]
