import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from benchmarks import engines as E
from jaxamp import NONFINITE_VALUES
from jaxamp.models import FullyConnected

STRICT_FP16 = {"xla_allow_excess_precision": False}  # fp16 ops round to fp16, no f32 shortcuts


# jaxamp's engines and the benchmark-only forward-over-reverse engine (a point engine plugged
# into jaxamp.Derivatives through its documented `method=callable` extension point).
KINDS = jaxamp._src.derivatives.engine.METHODS + ("fwd_over_rev",)
# The default engine runs in the fast suite; the reference and benchmark-only engines with -m slow.
FAST_KINDS = [k if k == "forward" else pytest.param(k, marks=pytest.mark.slow) for k in KINDS]


def engine(kind, fn, **kw):
    if kind in jaxamp._src.derivatives.engine.METHODS:
        return jaxamp.Derivatives(fn, **kw, method=kind)
    return E.make_engine(kind, fn, **kw)


def small_net(dtype=jnp.float32, **kw):
    kw = dict(out_features=2, layer_size=16, nr_layers=2, activation="tanh", dtype=dtype) | kw
    return FullyConnected(**kw)


@pytest.fixture(scope="module")
def net_and_params():
    net = small_net()
    params = net.init(jax.random.PRNGKey(3), jnp.zeros(2))
    return net, params


@pytest.mark.parametrize("method", FAST_KINDS)
def test_fp32_derivatives_match_jax_hessian_and_nested_jacfwd(net_and_params, method):
    net, params = net_and_params
    names = ("u__x", "u__y", "v__x", "u__x__x", "u__x__y", "u__y__y", "v__y__x",
             "u__x__x__y", "v__y__y__y", "u__x__y__x")
    eng = engine(method, lambda p, x: net.apply(p, x), inputs=("x", "y"), outputs=("u", "v"), derivatives=names)
    pts = jax.random.uniform(jax.random.PRNGKey(1), (32, 2), minval=-1, maxval=1)
    with jax.default_matmul_precision("highest"):
        vals, flags = jax.jit(jaxamp.scaled(eng))({}, params, pts)
        f = lambda x: net.apply(params, x)
        jac = jax.jit(jax.vmap(jax.jacfwd(f)))(pts)  # [N, out, in]
        hess = jax.jit(jax.vmap(jax.hessian(f)))(pts)  # [N, out, in, in]
        third = jax.jit(jax.vmap(jax.jacfwd(jax.jacfwd(jax.jacfwd(f)))))(pts)  # [N, out, in, in, in]
    assert flags == {}
    o, i = {"u": 0, "v": 1}, {"x": 0, "y": 1}
    for name in names:
        base, *wrt = name.split("__")
        idx = (slice(None), o[base], *[i[w] for w in wrt])
        ref = {1: jac, 2: hess, 3: third}[len(wrt)][idx]
        np.testing.assert_allclose(vals[name], ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()), err_msg=name)
    np.testing.assert_allclose(vals["u"], jax.vmap(f)(pts)[:, 0], rtol=1e-5, atol=1e-6)


def test_derivatives_of_an_analytic_function_to_fourth_order():
    fn = lambda p, x: jnp.stack([jnp.sin(2 * x[0]) * jnp.exp(x[1])])
    eng = jaxamp.Derivatives(fn, inputs=("x", "y"), outputs=("u",), derivatives=("u__x__x__x__x", "u__x__y__y"))
    x, y = jnp.linspace(-1, 1, 7), jnp.linspace(0, 0.5, 7)
    vals = jax.jit(eng.__call__)(None, {"x": x, "y": y})
    np.testing.assert_allclose(vals["u__x__x__x__x"], 16 * jnp.sin(2 * x) * jnp.exp(y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vals["u__x__y__y"], 2 * jnp.cos(2 * x) * jnp.exp(y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vals["u__x"], 2 * jnp.cos(2 * x) * jnp.exp(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, method", [pytest.param("per_order_scaler", "reverse", marks=pytest.mark.slow),
                                          pytest.param("per_term_scaler", "reverse", marks=pytest.mark.slow),
                                          ("per_order_scaler", "forward"),
                                          pytest.param("per_term_scaler", "forward", marks=pytest.mark.slow),
                                          pytest.param("per_term_scaler", "fwd_over_rev", marks=pytest.mark.slow)])
def test_scaled_values_equal_unscaled_values(net_and_params, mode, method):
    """The fp16 config switches scaling on; the network itself stays fp32, so scaling and
    unscaling must leave the values unchanged up to fp32 rounding (exact for powers of 2)."""
    net, params = net_and_params
    names = ("u__x__x", "u__y", "v__x__y__y")
    fn = lambda p, x: net.apply(p, x)
    plain = jaxamp.Derivatives(fn, inputs=("x", "y"), outputs=("u", "v"), derivatives=names)
    scaled = engine(method, fn, inputs=("x", "y"), outputs=("u", "v"), derivatives=names,
                    amp=jaxamp.AmpConfig(dtype="float16", mode=mode))
    pts = jax.random.normal(jax.random.PRNGKey(2), (16, 2))
    ref = jax.jit(plain.__call__)(params, pts)
    run = jax.jit(jaxamp.scaled(scaled))
    for pick in (lambda i: 2.0 ** -(i + 1), lambda i: 0.3 + 0.1 * i):
        scales = {k: pick(i) for i, k in enumerate(scaled.scaler_keys)}
        vals, flags = run(scales, params, pts)
        assert set(flags) == {*scaled.scaler_keys, NONFINITE_VALUES} and not any(bool(f) for f in flags.values())
        for name in ref:
            atol = 1e-6 * float(jnp.abs(ref[name]).max())  # fp32 rounding relative to the field
            np.testing.assert_allclose(vals[name], ref[name], rtol=2e-6, atol=atol, err_msg=name)


@pytest.mark.parametrize("method", FAST_KINDS)
def test_scaling_reaches_the_derivative_pass(method):
    """The scale is the seed of each reverse pass (or each forward tangent): a huge scale
    overflows fp16 intermediates even though the unscaled value is small (excess precision
    disabled, see STRICT_FP16)."""
    amp = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True, autocast_activation=True)
    net = FullyConnected.from_amp(amp, out_features=1, layer_size=8, nr_layers=2)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros(1))
    eng = engine(method, lambda p, x: net.apply(p, x), inputs=("x",), outputs=("u",), derivatives=("u__x",), amp=amp)
    call = jax.jit(jaxamp.scaled(eng), compiler_options=STRICT_FP16)
    _, ok = call({"1": 1.0}, params, {"x": jnp.linspace(0, 1, 4)})
    _, bad = call({"1": 2.0**20}, params, {"x": jnp.linspace(0, 1, 4)})
    assert not bool(ok["1"]) and bool(bad["1"])


@pytest.mark.parametrize("method", FAST_KINDS)
def test_crafted_fp16_overflow_backs_off_to_fp32_values(method):
    """u__x__x overflows fp16 inside the second backward pass: the first layer runs in fp16
    (autocast_firstlayer=True) with weight_g x500, so |u_xx| reaches ~1.7e5 > 65504 while
    |u_x| stays ~700. Excess precision is ruled out by compiling with
    xla_allow_excess_precision=False (and the unscaled run must overflow, or this test fails)."""
    amp = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True)
    net16 = FullyConnected.from_amp(amp, out_features=1, layer_size=32, nr_layers=3)
    net32 = FullyConnected(out_features=1, layer_size=32, nr_layers=3)
    params = net16.init(jax.random.PRNGKey(0), jnp.zeros(1))
    params = jax.tree_util.tree_map_with_path(
        lambda path, v: (v * 500 if "layers_0" in jax.tree_util.keystr(path)
                         and "weight_g" in jax.tree_util.keystr(path) else v),
        params,
    )
    names = ("u__x__x",)
    e16 = engine(method, lambda p, x: net16.apply(p, x), inputs=("x",), outputs=("u",), derivatives=names, amp=amp)
    e32 = jaxamp.Derivatives(lambda p, x: net32.apply(p, x), inputs=("x",), outputs=("u",), derivatives=names)
    pts = {"x": jnp.linspace(-0.02, 0.02, 64)}
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(e32.__call__)(params, pts)
    assert float(jnp.abs(ref["u__x__x"]).max()) > 65504 > float(jnp.abs(ref["u__x"]).max())

    call = jax.jit(jaxamp.scaled(e16), compiler_options=STRICT_FP16)
    scalers = jaxamp.init(None, amp, keys=e16.scaler_keys)().derivative
    backoffs = 0
    while True:
        vals, found = call(scalers.scales, params, pts)
        if backoffs == 0:
            assert bool(found["2"]) and not bool(found["1"]), "only the second-order key overflows"
            assert not bool(found[NONFINITE_VALUES]), "an overflow is not a bad value"
            assert not bool(jnp.all(jnp.isfinite(vals["u__x__x"])))
        if not bool(found["2"]):
            break
        scalers = scalers.update({k: found[k] for k in scalers})
        backoffs += 1
        assert backoffs < 10
    assert backoffs >= 1 and float(scalers["2"].scale) == 0.5**backoffs and float(scalers["1"].scale) == 1.0
    assert bool(jnp.all(jnp.isfinite(vals["u__x__x"])))
    # fp16 tolerance: ~10 fp16 roundings (eps 2^-11) along the graph, relative to the field's max.
    scale_of_field = float(jnp.abs(ref["u__x__x"]).max())
    np.testing.assert_allclose(vals["u__x__x"], ref["u__x__x"], atol=1e-2 * scale_of_field)
    np.testing.assert_allclose(vals["u__x"], ref["u__x"], atol=1e-2 * float(jnp.abs(ref["u__x"]).max()))


def test_scaler_keys_per_mode_special_terms_and_custom_max_scales():
    fn = lambda p, x: jnp.stack([x[0] * x[1], x[0] ** 2, x[1]])
    kw = dict(inputs=("x", "y"), outputs=("u", "v", "nu"), derivatives=("u__x__y", "v__x__x", "nu__x", "nu__x__y"))
    per_order = jaxamp.Derivatives(fn, **kw, amp=jaxamp.AmpConfig())
    assert per_order.scaler_keys == ("1", "2")
    per_term = jaxamp.Derivatives(fn, **kw, amp=jaxamp.AmpConfig(mode="per_term_scaler"))
    assert set(per_term.scaler_keys) == {"u", "v", "nu", "u__x", "v__x", "nu__x"}
    special = jaxamp.Derivatives(
        fn, **kw, amp=jaxamp.AmpConfig(special_terms=["nu"], custom_max_scales_log2={"nu": 20, 2: 3})
    )
    assert set(special.scaler_keys) == {"1", "2", "nu"}
    assert special.scaler_key("nu") == "nu" and special.scaler_key("nu__x") == "2"
    rules = jaxamp.init(None, special.amp, keys=special.scaler_keys)().derivative.rules
    assert rules["nu"].max_scale == 2.0**20 and rules["2"].max_scale == 8.0 and rules["1"].max_scale == 1.0


@pytest.mark.parametrize("amp", [None, jaxamp.AmpConfig(dtype="bfloat16"), jaxamp.AmpConfig(dtype="float32"),
                                 jaxamp.AmpConfig(enabled=False)])
def test_inactive_scaling_adds_nothing_to_the_graph(net_and_params, amp):
    net, params = net_and_params
    fn = lambda p, x: net.apply(p, x)
    kw = dict(inputs=("x", "y"), outputs=("u", "v"), derivatives=("u__x__x", "v__y"))
    eng = jaxamp.Derivatives(fn, **kw, amp=amp)
    assert eng.scaler_keys == () and jaxamp.init(None, eng.amp, keys=eng.scaler_keys)().scales == {}
    pts = jnp.ones((4, 2))
    plain = jax.make_jaxpr(jaxamp.Derivatives(fn, **kw).__call__)(params, pts)
    assert str(jax.make_jaxpr(eng.__call__)(params, pts)) == str(plain)
    assert jaxamp.scaled(eng)({}, params, pts)[1] == {}  # and jaxamp.scaled checks nothing
    assert "is_finite" not in str(jax.make_jaxpr(lambda p, x: jaxamp.scaled(eng)({}, p, x))(params, pts))
    assert "is_finite" not in str(plain)


@pytest.mark.parametrize(
    "kwargs, exc, fragment",
    [
        (dict(derivatives=("w__x",)), ValueError, "differentiates 'w', which is not an output"),
        (dict(derivatives=("u__z",)), ValueError, "with respect to 'z', which is not an input"),
        (dict(derivatives="u__x"), TypeError, "must be a list of names"),
        (dict(inputs=("x", "x")), ValueError, "has duplicates"),
        (dict(inputs=("x__1",)), ValueError, "names must be identifiers without '__'"),
        (dict(outputs=("u", "x")), ValueError, "appear in both"),
        (dict(amp="float16"), TypeError, "must be an AmpConfig"),
        (dict(method="jet"), ValueError, "`method`='jet' is not supported"),
    ],
)
def test_bad_construction_is_rejected(kwargs, exc, fragment):
    args = dict(inputs=("x", "y"), outputs=("u",), derivatives=("u__x",)) | kwargs
    with pytest.raises(exc) as e:
        jaxamp.Derivatives(lambda p, x: x[:1], **args)
    assert fragment in str(e.value)


def test_bad_calls_are_rejected_at_trace_time():
    eng = jaxamp.Derivatives(lambda p, x: x[:1], inputs=("x", "y"), outputs=("u",), derivatives=("u__x",),
                             amp=jaxamp.AmpConfig())
    run = jaxamp.scaled(eng)
    good = {"1": jnp.float32(1)}
    with pytest.raises(ValueError, match=r"expected \[N, 2\]"):
        run(good, None, jnp.ones((4, 3)))
    with pytest.raises(KeyError, match="lacks input"):
        run(good, None, {"x": jnp.ones(4)})
    with pytest.raises(TypeError, match="floating point"):
        run(good, None, jnp.ones((4, 2), jnp.int32))
    with pytest.raises(KeyError, match=r"scaler key '1'"):
        run({}, None, jnp.ones((4, 2)))
    # Outside jaxamp.scaled a scaled engine is the plain derivative program (scale 1, no flags).
    plain = jaxamp.Derivatives(lambda p, x: x[:1], inputs=("x", "y"), outputs=("u",), derivatives=("u__x",))
    pts = jnp.arange(8.0).reshape(4, 2)
    got, want = eng(None, pts), plain(None, pts)
    assert set(got) == set(want) == {"u", "u__x"}
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    wrong_out = jaxamp.Derivatives(lambda p, x: x, inputs=("x", "y"), outputs=("u",), derivatives=("u__x",))
    with pytest.raises(ValueError, match=r"returned shape \(2,\)"):
        wrong_out(None, jnp.ones((4, 2)))


def _first_overflowing_loss_scale(method, scales):
    """The smallest loss scale 2^k (k = 0..40) at which the fp16 weight gradient of a second-
    derivative loss is non-finite (excess precision off), for the engine of ``method``."""
    amp = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True)
    net = FullyConnected.from_amp(amp, out_features=1, layer_size=16, nr_layers=2)
    params = net.init(jax.random.PRNGKey(5), jnp.zeros(1))
    eng = engine(method, lambda p, x: net.apply(p, x), inputs=("x",), outputs=("u",), derivatives=("u__x__x",),
                 amp=amp)
    x = {"x": jnp.linspace(-1.0, 1.0, 64)}

    run = jaxamp.scaled(eng)

    def grads(p, loss_scale):
        vals, _ = run(scales, p, x)
        return jax.grad(lambda p: loss_scale * jnp.mean(run(scales, p, x)[0]["u__x__x"] ** 2))(p), vals

    f = jax.jit(grads, compiler_options=STRICT_FP16)
    for k in range(41):
        g, vals = f(params, jnp.float32(2.0**k))
        assert bool(jnp.all(jnp.isfinite(vals["u__x__x"])))
        if not all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree_util.tree_leaves(g)):
            return k
    return None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forward", "fwd_over_rev"])
def test_forward_engines_weight_gradients_overflow_no_sooner_than_reverse(method):
    """With both derivative scales at 2^-8, the forward engines' float16 values carry the scale
    of their step (s_k, or s_k / s_{k-1}), as nested reverse mode does -- not s_{k-1} * s_k,
    whose weight-gradient cotangents are 1/(s_{k-1} s_k) = 2^16 times the loss and overflowed
    at loss scales ~2^7 below reverse mode's (measured on the Poisson parity pair before the
    seeds became s_k / s_{k-1})."""
    scales = {"1": jnp.float32(2.0**-8), "2": jnp.float32(2.0**-8)}
    ref = _first_overflowing_loss_scale("reverse", scales)
    assert ref is not None  # the case must overflow somewhere, or it tests nothing
    got = _first_overflowing_loss_scale(method, scales)
    assert got is not None and got >= ref - 1, (method, got, ref)
