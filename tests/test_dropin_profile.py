"""jaxamp.profile / init_scalers: the float16 range of a jaxamp.grad program, per key.

Oracles: the scaled derivatives it reports are the engine's (``Derivatives(method="reverse")``,
same network, every float16 operation promoted to float32); what it reports for a key scales
exactly with that key's seed (binary scaling is exact in float32) and no other key's
derivatives move with it, so it holds the values of that key's passes and nothing else (the
outer pass of a nested reverse derivative also holds s2/s1 values, see the test); and start
scales recommended from it
remove the overflows the float16 program flags at scale 1 (XLA CPU's excess precision on: the
overflows are in float16 dot outputs, which it rounds), while a derivative that is large only
in float32 (never held in float16) lowers no start scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._src.core import profile as ranges
from jaxamp._src.core.profile import scaler_keys
from jaxamp.models import FullyConnected
from jaxamp._src.core.window import LOG2_FP16_MAX, promote_to_float32, recommend, value_range
from tests.helpers.jax_user import INPUTS, batched, make_net, nested, physical_fourier_net, points

NAMES = ("u__t", "u__x__x")


@pytest.fixture(scope="module")
def net():
    return make_net(jaxamp.AmpConfig(), weight_scale=8.0)


@pytest.fixture(scope="module")
def profiler(net):
    """``prof(scales {"1", "2"}, params, points)``, jitted once for the module."""
    fn, amp = batched(net[1], NAMES), jaxamp.AmpConfig()
    return jax.jit(jaxamp.profile(fn, amp))


def _max(r):
    return float(r.log2_max)


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_derivatives_are_the_engines_scaled_derivatives(net, profiler):
    fn, _, params = net
    amp = jaxamp.AmpConfig()
    engine = jaxamp.Derivatives(fn, inputs=INPUTS, outputs=("u",), derivatives=NAMES, amp=amp, method="reverse")
    engine32 = jaxamp.Derivatives(promote_to_float32(fn), inputs=INPUTS, outputs=("u",), derivatives=NAMES,
                                  method="reverse")
    scales = {"1": jnp.float32(2.0**-3), "2": jnp.float32(2.0**-5)}
    ours = profiler(scales, params, points())
    values = jax.jit(engine32)(params, points())
    assert engine.scaler_key("u") == "1" and engine.scaler_key("u__x") == "2"
    assert set(ours.derivatives) == set(ours.hidden) == set(ours.keys) == {"1", "2"}
    # key "1" also checks u__x, the inner derivative of u__x__x (the engine computes it too)
    first = jnp.concatenate([values["u__t"], values["u__x"]]) * scales["1"]
    np.testing.assert_allclose(_max(ours.derivatives["1"]), _max(value_range(first)), atol=1e-5)
    np.testing.assert_allclose(_max(ours.derivatives["2"]), _max(value_range(values["u__x__x"] * scales["2"])),
                               atol=1e-5)
    # keys hold the float16 values only: these derivatives are float32 (the inputs are), so
    # a key's range is its hidden values' (the derivatives are reported, not fitted)
    for k in ("1", "2"):
        np.testing.assert_array_equal(np.asarray(ours.keys[k].log2_percentiles), ours.hidden[k].log2_percentiles)
        assert _max(ours.keys[k]) == _max(ours.hidden[k])


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
    f = jax.vmap(jaxamp.grad(jaxamp.grad(u_net, argnums=2), argnums=2), (None, 0, 0))
    run = jax.jit(jaxamp.scaled(f, amp))
    values, found = run({"1": 1.0, "2": 1.0}, params, pts["t"], pts["x"])
    assert bool(found["2"])
    prof = jax.jit(jaxamp.profile(f, amp))(None, params, pts["t"], pts["x"])
    assert _max(prof.hidden["2"]) > LOG2_FP16_MAX
    rec = recommend(prof)
    assert rec.scales_log2["2"] < 0
    values, found = run({k: 2.0 ** rec.scales_log2[k] for k in ("1", "2")}, params, pts["t"], pts["x"])
    assert not any(bool(v) for v in found.values()) and np.all(np.isfinite(values))


def test_init_scalers_from_the_profile_or_the_config(net):
    """Every derivative x 2**16: each key starts below 1 (the profile's recommendation applied
    to the config) and keeps the configured max scale 1; without the profile every key starts at 1."""
    _, u_net, params = net
    amp = jaxamp.AmpConfig(mode="per_term_scaler")
    big = batched(lambda p, t, x: 2.0**16 * u_net(p, t, x), NAMES)
    plain = ranges.init_scalers(big, amp, from_profile=False)(params, points())
    assert {k: float(v) for k, v in plain.scales.items()} == {"u": 1.0, "u__x": 1.0}
    assert set(plain.scales) == set(scaler_keys(big, amp)(params, points()))
    lowered = ranges.init_scalers(big, amp)(params, points())
    for k, v in lowered.scales.items():
        assert float(v) < 1.0 and float(v) == lowered.rules[k].init_scale, k
        assert lowered.rules[k].max_scale == plain.rules[k].max_scale == 1.0, k  # a start, not a cap
        assert lowered.rules[k].growth_interval == plain.rules[k].growth_interval, k
        assert lowered.rules[k] == amp_with_start(amp, k, float(v)).derivative_scaler_for(k), k


def test_inactive_scalers_give_an_empty_profile(net):
    _, u_net, params = net
    for amp in (jaxamp.AmpConfig(enabled=False), jaxamp.AmpConfig(derivative_scaling=False)):
        prof = jaxamp.profile(batched(u_net, NAMES), amp)(None, params, points())
        assert prof.derivatives == prof.hidden == prof.keys == {}
        assert len(ranges.init_scalers(batched(u_net, NAMES), amp)(params, points())) == 0


def test_errors_name_the_argument(net):
    _, u_net, params = net
    fn = batched(u_net, NAMES)
    with pytest.raises(TypeError, match="`fun`=3 must be callable"):
        jaxamp.profile(3)
    with pytest.raises(TypeError, match="`amp`"):
        jaxamp.profile(fn, {"mode": "per_order_scaler"})
    with pytest.raises(TypeError, match=r"`state`=.* must be None \(every scale 1\), a mapping"):
        jaxamp.profile(fn)([1.0])
    with pytest.raises(TypeError, match="`from_profile`='yes'"):
        ranges.init_scalers(fn, from_profile="yes")
    with pytest.raises(ValueError, match=r"`margin_log2`=-1 must be an integer in \[0, 15\]"):
        ranges.init_scalers(fn, margin_log2=-1)

    def looped(p, pts):
        return jax.lax.scan(lambda c, t: (c, nested(u_net, "u__t")(p, t, 0.5)), 0.0, pts["t"])[1]

    with pytest.raises(NotImplementedError, match="inside a `scan` body is not profiled"):
        jaxamp.profile(looped)(None, params, points())


def amp_with_start(amp, key, scale):
    """``amp`` with ``key`` starting at ``scale`` (a power of two)."""
    return jaxamp.AmpConfig.from_dict(amp.to_dict() | {"custom_init_scales_log2": {key: int(np.log2(scale))}})


def _length_scaled_net(in_float16: bool, length: float = 0.002):
    """``u(t, x) = net(z / length)`` with every layer of ``net`` in float16; ``z / length`` in
    float32 (a length scale divided out before the network) or, ``in_float16``, in float16."""
    amp = jaxamp.AmpConfig(autocast_firstlayer=True)
    model = FullyConnected.from_amp(amp, out_features=1, layer_size=16, nr_layers=2, activation="tanh")
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))

    def u_net(p, t, x):
        z = jnp.stack([t, x])
        if in_float16:
            return model.apply(p, z.astype(jnp.float16) * jnp.float16(1 / length))[0]
        return model.apply(p, z * (1 / length))[0]

    return amp, batched(u_net, NAMES), params, points(64, scale=length)


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_a_derivative_large_only_in_float32_lowers_no_start_scale():
    """u_xx = L^2 net'' with L = 1/0.002 applied in float32: the float32 derivative passes
    65504 while every float16 value stays small. The profile reports the derivative, fits only
    the float16 values: key "2" keeps its default start (0); and the float16 program at scale 1
    indeed flags nothing. The same network with the 1/L factor in float16 holds the large values
    in float16: there key "2" must start lower."""
    amp, fn, params, pts = _length_scaled_net(in_float16=False)
    prof = jax.jit(jaxamp.profile(fn, amp))(None, params, pts)
    assert _max(prof.derivatives["2"]) > LOG2_FP16_MAX  # float32, reported
    assert _max(prof.keys["2"]) == _max(prof.hidden["2"]) < LOG2_FP16_MAX - 2  # float16, fitted
    rec = recommend(prof)
    assert rec.scales_log2 == {"1": 0, "2": 0} and rec.custom_init_scales_log2 == {}
    values, found = jax.jit(jaxamp.scaled(fn, amp))({"1": 1.0, "2": 1.0}, params, pts)
    assert float(jnp.max(jnp.abs(values["u__x__x"]))) > 65504.0 and not any(bool(v) for v in found.values())
    scalers = ranges.init_scalers(fn, amp)(params, pts)
    assert {k: float(v) for k, v in scalers.scales.items()} == {"1": 1.0, "2": 1.0}

    amp, fn, params, pts = _length_scaled_net(in_float16=True)
    prof = jax.jit(jaxamp.profile(fn, amp))(None, params, pts)
    assert _max(prof.keys["2"]) > LOG2_FP16_MAX
    assert recommend(prof).scales_log2["2"] < 0


def test_a_state_brings_its_config_to_the_profile():
    u = lambda p, t, x: jnp.tanh((p * x + t).astype(jnp.float16)).astype(jnp.float32)  # noqa: E731

    def losses(p, t, x):
        u_xx = jaxamp.grad(jaxamp.grad(u, 2, of="u", wrt="x"), 2, wrt="x")
        return (jax.vmap(u_xx, (None, 0, 0))(p, t, x)
                + jax.vmap(jaxamp.grad(u, 1, of="u", wrt="t"), (None, 0, 0))(p, t, x))

    args = (3.0, jnp.linspace(0.0, 1.0, 8), jnp.linspace(0.0, 0.1, 8))
    state = jaxamp.init(losses, jaxamp.AmpConfig(mode="per_term_scaler"))(*args)
    assert sorted(jaxamp.profile(losses)(state, *args).keys) == sorted(state.scales) == ["u", "u__x"]
    assert sorted(jaxamp.profile(losses, jaxamp.AmpConfig())(None, *args).keys) == ["1", "2"]
