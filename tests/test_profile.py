"""The derivative-range profiler: analytic ranges, recommendations, no recompilation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import yaml

import jaxamp
from jaxamp._src.core.window import LOG2_FP16_MAX, NOTHING_TO_CHANGE, promote_to_float32, recommend, value_range


def profile(eng, params, points, scales=None):
    """jaxamp.profile of an engine, jitted (one compile instead of op-by-op dispatch)."""
    return jax.jit(jaxamp.profile(eng))(scales, params, points)


def _sine(k: float, dtype=jnp.float32):
    """``u(x) = a * sin(k x)`` computed in ``dtype``: u__x__x peaks at ``a k^2``."""

    def fn(p, x):
        z = x.astype(dtype) * jnp.asarray(k, dtype)
        return (jnp.sin(z) * p["a"].astype(dtype)).astype(jnp.float32)

    return fn


def _engine(fn, amp=None):
    return jaxamp.Derivatives(fn, inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=amp)


POINTS = jnp.linspace(0.0, 1.0, 1001)[:, None]


@pytest.mark.parametrize("k", [3.0, 40.0])
def test_profile_matches_analytic_range(k):
    params = {"a": jnp.float32(1.5)}
    prof = profile(_engine(_sine(k), jaxamp.AmpConfig()), params, POINTS)
    # max |u__x| = a k (key "1"), max |u__x__x| = a k^2 (key "2") on a grid dense enough to
    # reach the peaks; float32 derivatives are reported, not fitted (keys hold float16 only)
    np.testing.assert_allclose(float(prof.derivatives["1"].log2_max), math.log2(1.5 * k), atol=1e-3)
    np.testing.assert_allclose(float(prof.derivatives["2"].log2_max), math.log2(1.5 * k * k), atol=1e-3)
    assert prof.keys == {} and prof.hidden == {}
    up = float(prof.derivatives["2"].headroom_up)
    np.testing.assert_allclose(up, LOG2_FP16_MAX - math.log2(1.5 * k * k), atol=1e-3)


def test_scales_shift_the_range_by_their_exponent():
    params = {"a": jnp.float32(1.0)}
    eng = _engine(_sine(10.0, jnp.float16), jaxamp.AmpConfig())
    base = profile(eng, params, POINTS)
    scaled = profile(eng, params, POINTS, {"1": jnp.float32(1.0), "2": jnp.float32(2.0**-5)})
    np.testing.assert_allclose(float(scaled.keys["2"].log2_max), float(base.keys["2"].log2_max) - 5, atol=1e-5)
    assert float(scaled.keys["1"].log2_max) == float(base.keys["1"].log2_max)


def test_percentiles_are_numpys_over_the_nonzero_values():
    ranged = jax.jit(value_range)
    for n in (1, 2, 7, 1000):
        values = np.asarray(np.random.default_rng(n).normal(size=n) * 1e3, np.float32)
        values = np.concatenate([values, np.zeros(5, np.float32)])
        expected = np.percentile(np.log2(np.abs(values[values != 0])), [1.0, 50.0, 99.0])
        np.testing.assert_allclose(ranged(values).log2_percentiles, expected, rtol=1e-5, atol=1e-5, err_msg=n)
    assert np.all(np.asarray(ranged(np.zeros(3)).log2_percentiles) == -np.inf)


def test_fractions_outside_the_window():
    r = value_range(jnp.array([1e-6, 1.0, 7e4, 0.0]))
    assert float(r.frac_subnormal) == pytest.approx(1 / 3)
    assert float(r.frac_overflow) == pytest.approx(1 / 3)
    assert float(r.headroom_up) < 0


def test_promoted_network_runs_in_float32_on_the_same_graph():
    fn = _sine(300.0, jnp.float16)
    promoted = promote_to_float32(fn)
    jaxpr = jax.make_jaxpr(lambda x: promoted({"a": jnp.float32(1.0)}, x))(jnp.ones((1,)))
    assert "f16" not in str(jaxpr)
    x = jnp.array([0.3])
    np.testing.assert_allclose(promoted({"a": jnp.float32(1.0)}, x), jnp.sin(300.0 * x), rtol=1e-6)


def test_hidden_layer_tangents_of_a_network():
    amp = jaxamp.AmpConfig()
    net = jaxamp.models.FullyConnected.from_amp(amp, 1, layer_size=8, nr_layers=2, activation="tanh")
    params = net.init(jax.random.PRNGKey(0), jnp.zeros((1,)))
    eng = _engine(lambda p, x: net.apply(p, x), amp)
    prof = profile(eng, params, POINTS[:64])
    # the float16 tangents of the hidden layers, per key; the float32 derivatives are reported
    assert set(prof.hidden) == set(prof.keys) == set(prof.derivatives) == {"1", "2"}
    for k in ("1", "2"):
        assert (np.isfinite(float(prof.hidden[k].log2_max))
                and float(prof.keys[k].log2_max) == float(prof.hidden[k].log2_max))


def test_profiling_inside_jit_does_not_recompile():
    traces = []
    eng = _engine(_sine(5.0), jaxamp.AmpConfig())

    @jax.jit
    def step(params, scales):
        traces.append(1)
        return jaxamp.profile(eng)(scales, params, POINTS[:32])

    for i in range(3):
        step({"a": jnp.float32(1.0 + i)}, {"1": jnp.float32(1.0), "2": jnp.float32(2.0**-i)})
    assert len(traces) == 1


def test_recommendation_fits_every_key_with_its_margin():
    params = {"a": jnp.float32(1.0)}
    prof = profile(_engine(_sine(300.0, jnp.float16), jaxamp.AmpConfig()), params, POINTS)  # u__x__x ~ 9e4
    rec = recommend(prof, margin_log2=2)
    assert rec.scales_log2["1"] == 0 and "1" not in rec.custom_init_scales_log2
    top = float(prof.keys["2"].log2_max) + rec.scales_log2["2"]
    assert LOG2_FP16_MAX - 3 <= top <= LOG2_FP16_MAX - 2
    assert rec.to_yaml() == f'amp:\n  custom_init_scales_log2:\n    "2": {rec.scales_log2["2"]}\n'
    assert jaxamp.AmpConfig.from_dict(yaml.safe_load(rec.to_yaml())) == rec.apply(jaxamp.AmpConfig())
    with pytest.raises(ValueError, match="margin_log2"):
        recommend(prof, margin_log2=-1)


def test_recommended_scales_remove_a_crafted_overflow():
    """Excess precision off for this program (XLA's compiler option, as
    ``XLA_FLAGS=--xla_allow_excess_precision=false`` sets it process-wide), so float16 really
    rounds and overflows: scales 1 overflow key 2, the recommended scales do not."""
    def fn(p, x):
        z = x.astype(jnp.float16) * jnp.float16(300.0)
        return (jnp.sin(z) * p["a"].astype(jnp.float16)).astype(jnp.float32)

    eng = _engine(fn, jaxamp.AmpConfig())
    params = {"a": jnp.float32(1.0)}
    x = jnp.linspace(0.0, 1.0, 512)[:, None]
    run = jax.jit(jaxamp.scaled(eng), compiler_options={"xla_allow_excess_precision": False})
    _, flags = run({"1": jnp.float32(1.0), "2": jnp.float32(1.0)}, params, x)
    rec = recommend(profile(eng, params, x))
    _, flags2 = run({k: jnp.float32(2.0**e) for k, e in rec.scales_log2.items()}, params, x)
    assert [bool(flags["2"]), bool(flags2["2"])] == [True, False], (flags, flags2)
    assert rec.scales_log2["2"] < 0


def test_recommendation_applied_to_amp_starts_each_key_at_its_scale_and_never_caps_it():
    prof = profile(_engine(_sine(300.0, jnp.float16), jaxamp.AmpConfig()), {"a": jnp.float32(1.0)}, POINTS)
    rec = recommend(prof)
    amp = rec.apply(jaxamp.AmpConfig(derivative_scaler={"growth_interval": 2, "recover_growth_interval": 2}))
    scalers = jaxamp.init(None, amp, keys=["1", "2"])().derivative
    assert float(scalers["2"].scale) == 2.0 ** rec.scales_log2["2"] < 1.0
    assert float(scalers["1"].scale) == 1.0
    assert dict(amp.custom_init_scales_log2) == {"2": rec.scales_log2["2"]} and dict(amp.custom_max_scales_log2) == {}
    # the max scale stays the configured one: clean steps grow key 2 back up to 1, not to its start
    rule = scalers.rules["2"]
    assert rule.max_scale == 1.0
    state = rule.init()
    for _ in range(2 * (1 - rec.scales_log2["2"]) * rule.growth_interval):
        state = rule.update(state, False)
        if float(state.scale) == 1.0:
            break
    assert float(state.scale) == 1.0


def test_apply_keeps_a_start_at_or_below_a_lower_custom_max_scale():
    rec = jaxamp._src.core.window.Recommendation(scales_log2={"1": 0, "2": -3},
                                                 custom_init_scales_log2={"2": -3}, margin_log2=2)
    amp = rec.apply(jaxamp.AmpConfig(custom_max_scales_log2={2: -9}, custom_init_scales_log2={"nu": -1}))
    assert dict(amp.custom_init_scales_log2) == {"nu": -1, "2": -9} and amp.max_scale_log2("2") == -9


def test_an_empty_recommendation_says_that_nothing_changes():
    prof = profile(_engine(_sine(3.0, jnp.float16), jaxamp.AmpConfig()), {"a": jnp.float32(1.0)}, POINTS)
    rec = recommend(prof)
    assert rec.custom_init_scales_log2 == {} and rec.scales_log2 == {"1": 0, "2": 0}
    assert rec.to_yaml() == NOTHING_TO_CHANGE and "nothing to change" in rec.to_yaml()
    assert "amp:" not in rec.to_yaml() and yaml.safe_load(rec.to_yaml()) is None  # a comment, valid YAML
    assert rec.apply(jaxamp.AmpConfig()) == jaxamp.AmpConfig()
