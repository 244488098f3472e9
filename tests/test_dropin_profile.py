"""jaxamp.dropin.profile / init_scalers: the float16 range of a dropin.grad program, per key.

Oracles: the scaled derivatives it reports are the engine's (``Derivatives(method="reverse")``,
same network, every float16 operation promoted to float32); what it reports for a key scales
exactly with that key's seed (binary scaling is exact in float32) and no other key's
derivatives move with it, so it holds the values of that key's passes and nothing else (the
outer pass of a nested reverse derivative also holds s2/s1 values, see the test); and start
scales recommended from it
remove the overflows the float16 program flags at scale 1 (XLA CPU's excess precision on: the
overflows are in float16 dot outputs, which it rounds).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import dropin
from jaxamp.profile import promote_to_float32, recommend, value_range
from tests.helpers.jax_user import INPUTS, batched, make_net, nested, physical_fourier_net, points

NAMES = ("u__t", "u__x__x")


@pytest.fixture(scope="module")
def net():
    return make_net(jaxamp.AmpConfig(), weight_scale=8.0)


@pytest.fixture(scope="module")
def profiler(net):
    """``prof(scales {"1", "2"}, params, points)``, jitted once for the module."""
    return jax.jit(dropin.profile(batched(net[1], NAMES), jaxamp.AmpConfig()))


def _max(r):
    return float(r.log2_max)


def test_derivatives_are_the_engines_scaled_derivatives(net, profiler):
    fn, _, params = net
    amp = jaxamp.AmpConfig()
    engine = jaxamp.Derivatives(fn, inputs=INPUTS, outputs=("u",), derivatives=NAMES, amp=amp, method="reverse")
    engine32 = jaxamp.Derivatives(promote_to_float32(fn), inputs=INPUTS, outputs=("u",), derivatives=NAMES,
                                  method="reverse")  # fmt: skip
    scales = {"1": jnp.float32(2.0**-3), "2": jnp.float32(2.0**-5)}
    ours = profiler(scales, params, points())
    values = jax.jit(engine32)(params, points())[0]
    assert engine.scaler_key("u") == "1" and engine.scaler_key("u__x") == "2"
    assert set(ours.derivatives) == set(ours.hidden) == set(ours.keys) == {"1", "2"}
    # key "1" also checks u__x, the inner derivative of u__x__x (the engine computes it too)
    first = jnp.concatenate([values["u__t"], values["u__x"]]) * scales["1"]
    np.testing.assert_allclose(_max(ours.derivatives["1"]), _max(value_range(first)), atol=1e-5)
    np.testing.assert_allclose(_max(ours.derivatives["2"]), _max(value_range(values["u__x__x"] * scales["2"])), atol=1e-5)
    for k in ("1", "2"):
        assert _max(ours.keys[k]) == max(_max(ours.derivatives[k]), _max(ours.hidden[k]))


@pytest.mark.parametrize("key", ["1", "2"])
def test_a_key_holds_exactly_the_values_its_seed_scales(net, profiler, key):
    """Scaling one key's seed by 2**-5 moves that key's whole range by -5 and no other key's
    derivatives. (Key "2"'s passes also hold values scaled by s2/s1, the transposed unscale of
    the inner derivative, so a smaller s1 moves part of key "2"'s hidden range up: not compared.)"""
    params, ones = net[2], {"1": 1.0, "2": 1.0}
    base = profiler(ones, params, points())
    moved = profiler(ones | {key: 2.0**-5}, params, points())
    pairs = [("derivatives", "1"), ("derivatives", "2"), ("hidden", "1")] + [("hidden", "2")] * (key == "2")
    for group, k in pairs:
        shift = -5.0 if k == key else 0.0
        a, b = getattr(base, group)[k], getattr(moved, group)[k]
        np.testing.assert_allclose(b.log2_percentiles, a.log2_percentiles + shift, atol=1e-4, err_msg=(group, k))
        np.testing.assert_allclose(_max(b), _max(a) + shift, atol=1e-5, err_msg=(group, k))
    if key == "1":
        assert _max(moved.hidden["2"]) > _max(base.hidden["2"])


def test_recommended_start_scales_remove_the_overflows_of_scale_one():
    """examples/jax_user's network in physical units (domain x 0.02), first layer in float16:
    at scale 1 a float16 dot of u__x__x's reverse pass overflows. The profile's float16 values
    of key "2" pass 65504; the recommended start scales remove every flag."""
    amp = jaxamp.AmpConfig(autocast_firstlayer=True)
    u_net, params = physical_fourier_net(amp)
    pts = points(64, scale=0.02)
    f = jax.vmap(dropin.grad(dropin.grad(u_net, argnums=2), argnums=2), (None, 0, 0))
    run = jax.jit(dropin.scaled(f, amp))
    values, found = run({"1": 1.0, "2": 1.0}, params, pts["t"], pts["x"])
    assert bool(found["2"])
    prof = jax.jit(dropin.profile(f, amp))(None, params, pts["t"], pts["x"])
    assert _max(prof.hidden["2"]) > jaxamp.profile.LOG2_FP16_MAX
    rec = recommend(prof)
    assert rec.scales_log2["2"] < 0
    values, found = run({k: 2.0 ** rec.scales_log2[k] for k in ("1", "2")}, params, pts["t"], pts["x"])
    assert not any(bool(v) for v in found.values()) and np.all(np.isfinite(values))


def test_init_scalers_from_the_profile_or_the_config(net):
    """Every derivative x 2**16: each key starts below 1, at its max scale (the profile's
    recommendation applied to the config); without the profile every key starts at 1."""
    _, u_net, params = net
    amp = jaxamp.AmpConfig(mode="per_term_scaler")
    big = batched(lambda p, t, x: 2.0**16 * u_net(p, t, x), NAMES)
    plain = dropin.init_scalers(big, amp, from_profile=False)(params, points())
    assert {k: float(v) for k, v in plain.scales.items()} == {"u": 1.0, "u__x": 1.0}
    assert set(plain.scales) == set(dropin.scaler_keys(big, amp)(params, points()))
    lowered = dropin.init_scalers(big, amp)(params, points())
    for k, v in lowered.scales.items():
        assert float(v) < 1.0 and float(v) == lowered.rules[k].max_scale == lowered.rules[k].init_scale, k
        assert lowered.rules[k].growth_interval == plain.rules[k].growth_interval, k


def test_inactive_scalers_give_an_empty_profile(net):
    _, u_net, params = net
    for amp in (jaxamp.AmpConfig(enabled=False), jaxamp.AmpConfig(derivative_scaling=False)):
        prof = dropin.profile(batched(u_net, NAMES), amp)(None, params, points())
        assert prof.derivatives == prof.hidden == prof.keys == {}
        assert len(dropin.init_scalers(batched(u_net, NAMES), amp)(params, points())) == 0


def test_errors_name_the_argument(net):
    _, u_net, params = net
    fn = batched(u_net, NAMES)
    with pytest.raises(TypeError, match="`fun`=3 must be callable"):
        dropin.profile(3)
    with pytest.raises(TypeError, match="`amp`"):
        dropin.profile(fn, {"mode": "per_order_scaler"})
    with pytest.raises(TypeError, match="`scales`=.* must be None or a mapping"):
        dropin.profile(fn)([1.0], params, points())
    with pytest.raises(TypeError, match="`from_profile`='yes'"):
        dropin.init_scalers(fn, from_profile="yes")
    with pytest.raises(ValueError, match=r"`margin_log2`=-1 must be an integer in \[0, 15\]"):
        dropin.init_scalers(fn, margin_log2=-1)

    def looped(p, pts):
        return jax.lax.scan(lambda c, t: (c, nested(u_net, "u__t")(p, t, 0.5)), 0.0, pts["t"])[1]

    with pytest.raises(NotImplementedError, match="inside a `scan` body is not profiled"):
        dropin.profile(looped)(None, params, points())
