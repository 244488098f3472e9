"""jaxamp._src.taylor.second_order and the package's core: nested jax.jvp's values with one
propagated tangent; the primitive table; the pure second order as series(order=2)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._src import taylor
from jaxamp.models import FullyConnected
from jaxamp._src.taylor import faa_di_bruno, rules
from tests.helpers.taylor import FUNCTIONS, STRICT_FP16, cost, fp16_net, nested_second


FAST_FP32 = {(name, 0.3) for name in FUNCTIONS} | {("tanh_mlp", None), ("custom_jvp_and_where", 2.0**-3)}


@pytest.mark.parametrize("name, ratio", [
    case if case in FAST_FP32 else pytest.param(*case, marks=pytest.mark.slow)  # further variants: slow run
    for case in ((name, ratio) for ratio in [None, 2.0**-3, 0.3] for name in sorted(FUNCTIONS))
])
def test_fp32_matches_nested_jvp(name, ratio):
    f = FUNCTIONS[name]
    xs = jax.random.uniform(jax.random.PRNGKey(1), (8, 2), minval=-1, maxval=1)
    ts = 0.5 * jnp.eye(2)  # along x, then along y: one compiled program for both
    r = None if ratio is None else jnp.float32(ratio)

    def run(second):
        return jax.jit(jax.vmap(lambda t: jax.vmap(lambda x: second(f, x, t, r))(xs)))(ts)

    with jax.default_matmul_precision("highest"):
        got, ref = run(taylor.second_order), run(nested_second)
    for col in (0, 1):
        for g, e in zip(got, ref):
            g, e = g[col], e[col]
            np.testing.assert_allclose(g, e, rtol=2e-6, atol=2e-6 * float(jnp.abs(e).max() + 1e-30))


def test_fp16_matches_nested_jvp_and_overflows_where_it_does():
    """Float16 network, float32 first layer: values equal nested jvp's to fp16 rounding; with an
    outer seed large enough that nested jvp's outer tangent overflows, the interpreter's does too."""
    f, xs = fp16_net()
    t = jnp.zeros(2).at[0].set(2.0**-2)

    # the ratio is an argument: one compiled program per side serves both ratios
    ours = jax.jit(lambda r: jax.vmap(lambda x: taylor.second_order(f, x, t, r))(xs), compiler_options=STRICT_FP16)
    nested = jax.jit(lambda r: jax.vmap(lambda x: nested_second(f, x, t, r))(xs), compiler_options=STRICT_FP16)

    def both(ratio):
        return ours(ratio), nested(ratio)

    got, ref = both(jnp.float32(2.0**3))
    for g, e in zip(got, ref):
        assert bool(jnp.all(jnp.isfinite(e)))
        np.testing.assert_allclose(g, e, atol=4e-3 * float(jnp.abs(e).max()))
    got, ref = both(jnp.float32(2.0**22))  # outer tangents ~2^20 x |dz|: past 65504
    assert not bool(jnp.all(jnp.isfinite(ref[2]))), "the reference must overflow, or this tests nothing"
    np.testing.assert_array_equal(jnp.isfinite(got[2]), jnp.isfinite(ref[2]))


def test_tiny_scales_stay_finite_under_jit():
    """s1 = s2 = 2^-64 (scalers backed off after many overflows): the ratio s2 / s1**2 = 2^64 is
    applied as the factors (s2/s1, 1/s1), since XLA rewrites (s2/s1)/s1 as s2/(s1*s1), which
    flushes to zero on CPU and made inf * 0 = NaN."""
    amp = jaxamp.AmpConfig(dtype="float16")
    net = FullyConnected.from_amp(amp, out_features=1, layer_size=16, nr_layers=2)
    eng = jaxamp.Derivatives(lambda p, x: net.apply(p, x), inputs=("x",), outputs=("u",), derivatives=("u__x__x",),
                             amp=amp)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros(1))
    run = jax.jit(jaxamp.scaled(eng))  # the scales are arguments: one compiled program for every case
    for e in (-64, -100, -126):
        scales = {"1": jnp.float32(2.0**e), "2": jnp.float32(2.0**e)}
        vals, found = run(scales, params, {"x": jnp.linspace(0, 1, 8)})
        assert not bool(found["2"]) and bool(jnp.all(jnp.isfinite(vals["u__x__x"]))), e


def test_fp16_activations_scale_the_tangents_before_the_product(monkeypatch):
    """Float16 activations: d2f[t, t] may overflow where d2f[t, ratio * t] does not (ratio < 1),
    so the tangents are scaled by powers of two before the product (here each by 2^-6); the
    result stays finite exactly where nested jvp's does. Scaling d2f[t, t] afterwards (as
    float32 activations do) gives inf here: checked below, or this tests nothing."""
    f, xs = fp16_net("tanh", autocast_activation=True)
    t = jnp.zeros(2).at[0].set(2.0**8)  # tangents ~2^8 |dz|: their square passes 65504
    ratio = jnp.float32(2.0**-12)

    def run(fn):
        return jax.jit(jax.vmap(fn), compiler_options=STRICT_FP16)(xs)

    got = run(lambda x: taylor.second_order(f, x, t, ratio))
    ref = run(lambda x: nested_second(f, x, t, ratio))
    unit = run(lambda x: taylor.second_order(f, x, t, None))
    assert not bool(jnp.all(jnp.isfinite(unit[2]))), "d2f[t, t] must overflow, or this tests nothing"
    np.testing.assert_array_equal(jnp.isfinite(got[2]), jnp.isfinite(ref[2]))
    assert bool(jnp.any(jnp.isfinite(ref[2]) & ~jnp.isfinite(unit[2])))
    for g, e in zip(got, ref):
        fin = jnp.isfinite(e)
        np.testing.assert_allclose(g[fin], e[fin], atol=2e-2 * float(jnp.abs(e[fin]).max()))
    monkeypatch.setattr(faa_di_bruno, "SCALE_AFTER_MIN_BITS", 16)  # float16 counts as wide: scale after
    assert not bool(jnp.all(jnp.isfinite(run(lambda x: taylor.second_order(f, x, t, ratio))[2])))


@pytest.mark.parametrize("placement", [{}, {"autocast_activation": True, "autocast_firstlayer": True}])
def test_series_of_order_2_is_second_order(placement):
    """One implementation of the pure second order: series(order=2) with scales (s1, s2) and
    second_order with tangent s1 e and ratio (s2/s1, 1/s1) give the same bits, with jaxamp's
    placement (float32 activations: scale after) and all-float16 (tangents rescaled first)."""
    f, xs = fp16_net("tanh", **placement)
    e = jnp.zeros(2).at[1].set(1.0)
    for s1, s2 in ((2.0**-2, 2.0**-5), (2.0**6, 2.0**3)):
        s1, s2 = jnp.float32(s1), jnp.float32(s2)
        y, (d1, d2) = jax.jit(jax.vmap(lambda x: taylor.series(f, x, e, 2, (s1, s2))), compiler_options=STRICT_FP16)(xs)
        ref = jax.jit(jax.vmap(lambda x: taylor.second_order(f, x, e * s1, (s2 / s1, 1.0 / s1))),
                      compiler_options=STRICT_FP16)(xs)
        for g, r in zip((y, d1, d2), ref):
            np.testing.assert_array_equal(g, r)


def test_primitive_table():
    """Degrees: linear primitives 1, bilinear ones 1 or 2 by their dependent operands, others
    unbounded; jit bodies are entered, remat bodies and custom_jvp calls are not."""
    p = jax.lax
    assert [rules.degree(q, 1) for q in (p.add_p, p.dot_general_p, p.mul_p, p.tanh_p)] == [1, 1, 1, None]
    assert [rules.degree(q, 2) for q in (p.add_p, p.dot_general_p, p.mul_p, p.exp_p)] == [1, 2, 2, None]
    assert rules.LINEAR.isdisjoint(rules.BILINEAR)

    def first(fn):
        return jax.make_jaxpr(fn)(1.0).jaxpr.eqns[0]

    assert rules.body(first(jax.jit(jnp.sin))) is not None
    assert rules.body(first(jax.checkpoint(jnp.sin))) is None
    assert rules.body(first(jax.nn.relu)) is None  # custom_jvp: its own rule, through jax.jvp
    # a remat body kept whole still gets its Taylor coefficients (by its nested jvp)
    y, d1, d2 = taylor.second_order(jax.checkpoint(lambda x: jnp.sin(x) * x), jnp.float32(0.5), jnp.float32(1.0), None)
    np.testing.assert_allclose(d2, 2 * jnp.cos(0.5) - 0.5 * jnp.sin(0.5), rtol=1e-6)


@functools.lru_cache(maxsize=None)
def _laplacian_costs(variant: str, scale_after_min_bits: int):
    """XLA's (flops, bytes) of a weight gradient through u_x, u_xx + u_yy of a 3x128 float16
    network (float32 first layer and activations) at 256 points, the scales traced;
    ``variant`` names ``second(f, x, col, s1, s2) -> (u, s1 u_col, s2 u_col_col)`` below; the
    cache key holds faa_di_bruno.SCALE_AFTER_MIN_BITS, which the trace reads."""
    second = {"unscaled": _unscaled, "scaled": _scaled, "nested": _nested}[variant]
    amp = jaxamp.AmpConfig(dtype="float16")
    net = FullyConnected.from_amp(amp, out_features=1, layer_size=128, nr_layers=3)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros(2))
    pts = jax.random.uniform(jax.random.PRNGKey(1), (256, 2))

    def loss(p, s1, s2):
        def point(x):
            f = lambda z: net.apply(p, z)  # noqa: E731
            _, dx, dxx = second(f, x, 0, s1, s2)
            _, _, dyy = second(f, x, 1, s1, s2)
            return dx[0] / s1, dxx[0] / s2, dyy[0] / s2

        dx, dxx, dyy = jax.vmap(point)(pts)
        return jnp.mean((dxx + dyy) ** 2) + jnp.mean(dx**2)

    return cost(jax.grad(loss), params, jnp.float32(2.0**-2), jnp.float32(2.0**-5))


def _costs(variant: str):
    return _laplacian_costs(variant, faa_di_bruno.SCALE_AFTER_MIN_BITS)


def _unit(col, s=1.0):
    return jnp.zeros(2).at[col].set(s)


def _unscaled(f, x, col, s1, s2):
    return taylor.second_order(f, x, _unit(col), None)


def _scaled(f, x, col, s1, s2):
    return taylor.second_order(f, x, _unit(col, s1), (s2 / s1, 1.0 / s1))


def _nested(f, x, col, s1, s2):
    return nested_second(f, x, _unit(col, s1), (s2 / s1, 1.0 / s1))


@pytest.mark.slow  # compiles weight gradients of a 3x128 network at 256 points
def test_scaled_second_order_costs_no_more_flops_than_unscaled():
    """Per-order scaling gives the two tangents of u_xx different seeds (s1, s2/s1). The pure
    second order must still propagate one tangent chain: the XLA FLOP count of a scaled weight
    gradient stays within 2 % of the unscaled one. Nested jax.jvp with the same seeds is
    measured too, and must cost more, or this test could not fail."""
    base = _costs("unscaled")[0]
    got = _costs("scaled")[0]
    old = _costs("nested")[0]
    assert got <= 1.02 * base, (got, base)
    assert old > 1.05 * base, (old, base)


@pytest.mark.slow  # compiles weight gradients of a 3x128 network at 256 points
def test_float32_activations_scale_after_and_move_no_more_bytes_than_unscaled(monkeypatch):
    """With float32 activations the second-order term is d2f[t, t] scaled afterwards, so the
    weight gradient stores no scaled tangent: XLA's bytes accessed stay at the unscaled step's
    up to the scalar factors (under 0.1 %, less than one stored float16 tangent of one layer,
    256 x 128 x 2 bytes = 0.12 %). Scaling the tangents first is measured too and must move
    more, or this test could not fail."""
    base = _costs("unscaled")[1]
    got = _costs("scaled")[1]
    monkeypatch.setattr(faa_di_bruno, "SCALE_AFTER_MIN_BITS", 65)  # no dtype qualifies: scale first
    before = _costs("scaled")[1]
    assert got <= 1.001 * base, (got, base)
    assert before > 1.02 * got, (before, got)
