"""The scale rule: the test vectors of docs/algorithm.md#test-vectors in torch_ref, and jaxamp == torch_ref on
10 000 random steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxamp
import torch_ref
from jaxamp._src.scaling.scaler import DynamicScaler
from torch_ref.models import FullyConnected


def test_spec_vector_1_rule():
    rule = torch_ref.DynamicScaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2,
                                   max_scale=8.0, recover_threshold=2.0, recover_growth_interval=1)
    flags = [False] * 6 + [True] * 2 + [False] * 4
    want = [(4, 1), (8, 0), (8, 1), (8, 0), (8, 1), (8, 0), (2, 0), (0.5, 0), (1, 0), (2, 0), (4, 0), (4, 1)]
    state, got = rule.init(), []
    for f in flags:
        state = rule.update(state, f)
        got.append((float(state.scale), int(state.growth_tracker)))
    assert got == want


def test_spec_vector_2_through_a_tanh_mlp():
    """Deriv scaler (init 1, max 2, interval 2, recover <= 0.5 every 1) driven by a real fp16 tanh MLP."""
    amp = torch_ref.AmpSettings(dtype="float16", default_max_scale_log2=1,
                                derivative_scaler={"growth_interval": 2, "recover_threshold": 0.5,
                                                   "recover_growth_interval": 1})
    torch.manual_seed(0)
    net = FullyConnected.from_amp(amp, 1, 1, layer_size=16, nr_layers=2, activation="tanh")
    # sqrt's derivative is inf at 0 while its value is finite: a true overflow (a NaN input would
    # be bad values, which change no scaler).
    engine = torch_ref.Derivatives(lambda x: net(x) + torch.sqrt(x), inputs=["x"], outputs=["u"],
                                   derivatives=["u__x"], amp=amp)
    (key,) = engine.scaler_keys
    rule, state = engine.scalers[key], engine.init_scaler_states()[key]
    assert (float(state.scale), int(state.growth_tracker)) == (1.0, 0)
    clean, bad = torch.linspace(0.1, 1, 8), torch.linspace(0.0, 1, 8)
    got = []
    for pts in [clean] * 4 + [bad] * 3 + [clean] * 3:
        _, found = engine({"x": pts}, {key: state.scale})
        state = rule.update(state, found[key])
        got.append((float(state.scale), int(state.growth_tracker)))
    assert got == [(1, 1), (2, 0), (2, 1), (2, 0), (1, 0), (0.5, 0), (0.25, 0), (0.5, 0), (1, 0), (1, 1)]


RULE = dict(init_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=16, max_scale=4.0,
            recover_threshold=2.0**-3, recover_growth_interval=3)


def _jax_trajectory(rule, flags):
    def body(s, f):
        s = rule.update(s, f)
        return s, (s.scale, s.growth_tracker)

    _, (scales, trackers) = jax.jit(lambda fl: jax.lax.scan(body, rule.init(), fl))(jnp.asarray(flags))
    return np.asarray(scales), np.asarray(trackers)


def _torch_trajectory(rule, flags):
    state, scales, trackers = rule.init(), [], []
    for f in flags.tolist():
        state = rule.update(state, f)
        scales.append(state.scale)
        trackers.append(state.growth_tracker)
    return torch.stack(scales).numpy(), torch.stack(trackers).numpy()


@pytest.mark.parametrize("p_inf,min_scale", [(0.05, None), (0.3, 2.0**-60)])
def test_random_found_inf_sequence_10000_steps(p_inf, min_scale):
    """Identical (scale, tracker) after every one of 10 000 random updates.

    With p_inf=0.3 the scale would otherwise sink below float32's normal range (see
    test_subnormal_scales_differ), so that case runs with a floor (min_scale).
    """
    # alternate 1000 steps of overflow probability p_inf with 1000 nearly clean steps
    p = np.where(np.arange(10_000) % 2000 < 1000, p_inf, 0.01)
    flags = np.random.default_rng(int(p_inf * 100)).random(10_000) < p
    rule = dict(RULE, min_scale=min_scale)
    js, jt = _jax_trajectory(DynamicScaler(**rule), flags)
    ts, tt = _torch_trajectory(torch_ref.DynamicScaler(**rule), flags)
    np.testing.assert_array_equal(js, ts)
    np.testing.assert_array_equal(jt, tt)
    # the sequence exercised every branch: backoff, recover growth, normal growth, the cap
    assert ts.min() < RULE["recover_threshold"] and (ts == RULE["max_scale"]).any()
    if min_scale is not None:
        assert ts.min() == min_scale


def test_scales_stop_at_the_smallest_normal_float32_in_both():
    """XLA on CPU flushes float32 subnormals to zero while torch keeps them; without a floor
    130 backoffs would leave jaxamp at 0 (which never grows back) and torch at 2^-130. Both
    rules therefore floor the scale at 2^-126, and agree step for step."""
    flags = np.array([True] * 130 + [False] * 3)
    js, _ = _jax_trajectory(DynamicScaler(**RULE), flags)
    ts, _ = _torch_trajectory(torch_ref.DynamicScaler(**RULE), flags)
    np.testing.assert_array_equal(js, ts)
    assert ts[129] == np.float32(2.0**-126) and ts.min() == np.float32(2.0**-126)


@pytest.mark.parametrize("bad", [dict(init_scale=8.0, max_scale=4.0), dict(recover_threshold=8.0, max_scale=4.0),
                                 dict(recover_growth_interval=20, growth_interval=10), dict(backoff_factor=0.0),
                                 dict(growth_interval=0)])
def test_both_reject_the_same_bad_hyperparameters(bad):
    for cls in (DynamicScaler, torch_ref.DynamicScaler):
        with pytest.raises((ValueError, TypeError)) as e:
            cls(**bad)
        assert any(k in str(e.value) for k in bad)
