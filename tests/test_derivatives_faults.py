"""Derivative-engine flags: an overflow flags its scaler key, bad values flag NONFINITE_VALUES;
mask_nonfinite_points drops points with non-finite inputs; per-term paths share a pass.

Overflows here are float16 overflows of analytic functions compiled with excess precision off
(``compiler_options``), or injected infs; the flag rule itself is docs/algorithm.md "One
derivative step", step 3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES

STRICT_FP16 = {"xla_allow_excess_precision": False}
K = 300.0  # u = sin(K x) in float16: |u_x| <= 300, |u_xx| <= 9e4 > 65504 where |sin(K x)| > 0.73


def wave(p, x):
    """``u = sin(K x)``, ``v = x`` computed in float16; where ``x > 10``, ``v`` is inf (injected)
    and ``u`` is 0."""
    far = x[0] > 10.0
    h = jnp.where(far, jnp.zeros_like(x), x).astype(jnp.float16)
    v = jnp.where(far, jnp.float16(jnp.inf), h[0])
    return jnp.stack([jnp.sin(jnp.float16(K) * h[0]), v])


def wave_engine(method="forward", **kw):
    kw = dict(inputs=("x",), outputs=("u", "v"), derivatives=("u__x__x", "v__x"), amp=jaxamp.AmpConfig()) | kw
    return jaxamp.Derivatives(wave, method=method, **kw)


def flagged(found):
    return {k for k, v in found.items() if bool(v)}


SAFE = jnp.array([[1e-3], [2e-3], [-1e-3]], jnp.float32)  # |sin(K x)| <= 0.6: u_xx < 65504
PEAK = jnp.array([[np.pi / (2 * K)]], jnp.float32)  # sin(K x) = 1: u_xx ~ -9e4 overflows
NAN = jnp.array([[jnp.nan]], jnp.float32)
INF_OUT = jnp.array([[20.0]], jnp.float32)  # v = inf there, v_x = 0
# the forward engine in the fast suite, the reverse engine too with -m slow
FAST_METHOD = ["forward", pytest.param("reverse", marks=pytest.mark.slow)]


@pytest.mark.parametrize("method", jaxamp._src.derivatives.engine.METHODS)
@pytest.mark.parametrize(
    "points, scales, expected",
    [
        (SAFE, 1.0, set()),
        (jnp.concatenate([SAFE, NAN]), 1.0, {NONFINITE_VALUES}),
        (jnp.concatenate([SAFE, INF_OUT]), 1.0, {NONFINITE_VALUES}),
        (jnp.concatenate([SAFE, PEAK]), 1.0, {"2"}),
        (jnp.concatenate([SAFE, PEAK]), 0.5, set()),  # backing key 2 off cures the overflow
        # combinations of the cases above: -m slow
        pytest.param(jnp.concatenate([SAFE, PEAK, NAN]), 1.0, {"2", NONFINITE_VALUES}, marks=pytest.mark.slow),
        pytest.param(jnp.concatenate([PEAK, INF_OUT, SAFE]), 1.0, {"2", NONFINITE_VALUES}, marks=pytest.mark.slow),
    ],
    ids=["finite", "nan-input", "inf-output", "overflow", "overflow-cured", "nan+overflow", "inf-output+overflow"],
)
def test_overflow_flags_its_key_and_bad_values_flag_nonfinite_values(method, points, scales, expected):
    eng = wave_engine(method)
    vals, found = jax.jit(jaxamp.scaled(eng), compiler_options=STRICT_FP16)({"1": 1.0, "2": scales}, None, points)
    assert set(found) == {"1", "2", NONFINITE_VALUES}
    assert flagged(found) == expected
    if "2" in expected:  # the overflow is real: u_xx is inf at the peak, finite below it
        peak = int(jnp.argmax(jnp.all(points == PEAK, axis=1)))
        assert not bool(jnp.isfinite(vals["u__x__x"][peak])) and bool(jnp.isfinite(vals["u__x"][peak]))


def test_a_first_order_overflow_is_not_a_bad_value_for_the_order_above():
    """u_x overflows (key 1) at x = 0 (|u_x| = 300, scaled by 2^9); u_xx, whose level below is
    then inf, flags nothing more."""
    eng = wave_engine()
    zero = jnp.zeros((1, 1), jnp.float32)
    vals, found = jax.jit(jaxamp.scaled(eng), compiler_options=STRICT_FP16)({"1": 2.0**9, "2": 1.0}, None, zero)
    assert not bool(jnp.isfinite(vals["u__x"][0]))
    assert flagged(found) == {"1"}


def test_unscaled_engines_check_nothing():
    eng = wave_engine(amp=None)
    vals, found = jax.jit(jaxamp.scaled(eng))({}, None, jnp.concatenate([SAFE, NAN, PEAK]))
    assert found == {} and bool(jnp.isnan(vals["u"][3]))


@pytest.mark.parametrize("method", FAST_METHOD)
def test_masked_points_are_zero_unflagged_and_weighted_out(method):
    masked = wave_engine(method, mask_nonfinite_points=True)
    plain = wave_engine(method)
    pts = jnp.concatenate([SAFE, NAN, jnp.array([[jnp.inf]], jnp.float32), SAFE])
    call = jax.jit(jaxamp.scaled(masked), compiler_options=STRICT_FP16)
    call_plain = jax.jit(jaxamp.scaled(plain), compiler_options=STRICT_FP16)
    scales = {"1": 1.0, "2": 1.0}
    vals, found = call(scales, None, pts)
    ref, ref_found = call_plain(scales, None, jnp.concatenate([SAFE, SAFE]))
    assert not flagged(found) and not flagged(ref_found)
    w = masked.point_weights(pts)
    np.testing.assert_array_equal(w, [1, 1, 1, 0, 0, 1, 1, 1])
    for name in masked.names:
        np.testing.assert_array_equal(vals[name][w > 0], ref[name], err_msg=name)
        np.testing.assert_array_equal(vals[name][w == 0], 0.0, err_msg=name)
    # A masked point does not hide other faults: an overflow or an inf output still flags.
    _, found = call(scales, None, jnp.concatenate([pts, PEAK, INF_OUT]))
    assert flagged(found) == {"2", NONFINITE_VALUES}
    # Without masking every point weighs 1 and the NaN point is a bad value.
    np.testing.assert_array_equal(plain.point_weights(pts), np.ones(8))
    assert flagged(call_plain(scales, None, pts)[1]) == {NONFINITE_VALUES}


@pytest.mark.slow  # an end-to-end run (fast-suite budget); CI runs it
def test_masked_weight_gradient_is_finite_and_ignores_masked_points():
    """A weighted residual mean over masked points has a finite gradient equal to the mean over
    the finite points alone (the stand-in's values never reach the loss)."""
    fn = lambda p, x: jnp.stack([jnp.tanh(p * x[0]) * x[1]])  # noqa: E731
    kw = dict(inputs=("x", "y"), outputs=("u",), derivatives=("u__x__x",))
    masked = jaxamp.Derivatives(fn, **kw, mask_nonfinite_points=True)
    plain = jaxamp.Derivatives(fn, **kw)
    good = jnp.array([[0.1, 1.0], [0.3, -2.0], [-0.2, 0.5]])
    pts = jnp.concatenate([good, jnp.array([[jnp.nan, 1.0], [0.2, jnp.inf]])])

    def loss(p, eng, x):
        w = eng.point_weights(x)
        r = eng(p, x)["u__x__x"]
        return jnp.sum(w * r**2) / jnp.maximum(jnp.sum(w), 1.0)

    g = jax.grad(loss)(jnp.float32(1.5), masked, pts)
    ref = jax.grad(loss)(jnp.float32(1.5), plain, good)
    assert bool(jnp.isfinite(g)) and float(g) == pytest.approx(float(ref), rel=1e-6)


def test_mask_nonfinite_points_must_be_a_bool():
    with pytest.raises(TypeError, match="`mask_nonfinite_points`='yes' must be True or False"):
        wave_engine(mask_nonfinite_points="yes")


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_per_term_paths_share_one_pass():
    """Per-term paths along the same inputs (u__x__x, v__x__x, and p__x along a prefix) share
    one pass: the per-term trace holds as many primal ``sin`` evaluations as the per-order one
    (a pass per term held 16 against per-order's 8). Values and flags equal the reverse
    engine's, per-term, with a different scale for every key."""

    def fn(p, x):
        return jnp.stack([jnp.tanh(x[0] * x[1]), jnp.sin(x[0]), x[1] ** 3])

    ders = ("u__x__x", "u__y__y", "v__x__x", "v__y__y", "u__x__y", "p__x", "p__y")
    kw = dict(inputs=("x", "y"), outputs=("u", "v", "p"), derivatives=ders)
    pts = jax.random.uniform(jax.random.PRNGKey(0), (6, 2))
    count = {}
    for mode in ("per_order_scaler", "per_term_scaler"):
        eng = jaxamp.Derivatives(fn, **kw, amp=jaxamp.AmpConfig(mode=mode))
        # the engine's program as written (jaxamp.scaled's merge could hide a pass per term)
        count[mode] = str(jax.make_jaxpr(eng.__call__)(None, pts)).count(" sin ")
    assert count["per_term_scaler"] == count["per_order_scaler"], count
    scales = {k: jnp.float32(2.0 ** -(i % 3)) for i, k in enumerate(eng.scaler_keys)}
    ref = jaxamp.Derivatives(fn, **kw, amp=eng.amp, method="reverse")
    got, found = jax.jit(jaxamp.scaled(eng))(scales, None, pts)
    want, want_found = jax.jit(jaxamp.scaled(ref))(scales, None, pts)
    assert {k: bool(v) for k, v in found.items()} == {k: bool(v) for k, v in want_found.items()}
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
