"""The stall detector (jaxamp.StallMonitor) on synthetic step metrics."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp._src.training.monitor import MonitorState


def metrics(reason=jaxamp.SkipReason.APPLIED, flagged=(), scales=None):
    m = {"skipped": jnp.asarray(reason != jaxamp.SkipReason.APPLIED), "skip_reason": jnp.asarray(reason, jnp.int32),
         "scale_log2/loss": jnp.float32(16.0)}
    for key in ("1", "2"):
        m[f"found_inf/{key}"] = jnp.asarray(key in flagged)
        m[f"scale_log2/{key}"] = jnp.float32((scales or {}).get(key, 0.0))
    return m


def feed(monitor, sequence, state=None, update=None):
    state = monitor.init() if state is None else state
    for m in sequence:
        state = (update or monitor.update)(state, m)
    return state


@pytest.mark.parametrize("reason, flagged, cause", [
    (jaxamp.SkipReason.NONFINITE_VALUES, (), "bad values (non-finite inputs, network outputs or loss)"),
    (jaxamp.SkipReason.DERIVATIVE_OVERFLOW, ("2",), "overflow in derivative scaler `2`"),
    (jaxamp.SkipReason.NONFINITE_GRADS, (), "non-finite weight gradients"),
])
def test_consecutive_skips_name_the_reason_and_what_to_try(reason, flagged, cause):
    monitor = jaxamp.StallMonitor(max_consecutive_skips=5, window=100)
    state = feed(monitor, [metrics()] * 3 + [metrics(reason, flagged)] * 4)
    assert int(state.consecutive_skips) == 4 and monitor.diagnose(state, metrics(reason, flagged)) is None
    state = monitor.update(state, metrics(reason, flagged))
    line = monitor.diagnose(state, metrics(reason, flagged))
    assert line.startswith("jaxamp: training stalled at step 8: 5 consecutive skipped steps, the last for ")
    assert cause in line and "Try: " in line and "\n" not in line
    assert monitor.diagnose(monitor.update(state, metrics()), metrics()) is None  # an applied step ends the run


def test_skip_rate_over_a_full_window():
    monitor = jaxamp.StallMonitor(max_consecutive_skips=100, window=8, max_skip_rate=0.5)
    bad = metrics(jaxamp.SkipReason.NONFINITE_VALUES)
    state = feed(monitor, [bad, bad, metrics()] * 2)  # 4 of 6: the window is not full yet
    assert monitor.diagnose(state, metrics()) is None
    state = feed(monitor, [bad, metrics()], state)  # 5 of 8
    line = monitor.diagnose(state, metrics())
    assert "5 of the last 8 steps skipped, the last for bad values (non-finite inputs" in line
    state = feed(monitor, [metrics()] * 4, state)  # 2 of the last 8
    assert monitor.diagnose(state, metrics()) is None


def test_a_scale_at_its_floor():
    monitor = jaxamp.StallMonitor()
    line = monitor.diagnose(feed(monitor, [metrics()]), metrics(scales={"2": -126.0}))
    assert "scale `2` at its floor, the last for overflow in derivative scaler `2`" in line
    amp = jaxamp.AmpConfig(derivative_scaler={"min_scale": 2.0**-10})
    floored = jaxamp.StallMonitor(amp=amp)
    assert floored.floor_log2("2") == -10.0 and floored.floor_log2("loss") == -126.0
    assert floored.diagnose(floored.init(), metrics(scales={"1": -9.0})) is None
    assert "scale `1` at its floor" in floored.diagnose(floored.init(), metrics(scales={"1": -10.0}))


def test_update_is_pure_and_the_same_under_jit_and_scan():
    monitor = jaxamp.StallMonitor(max_consecutive_skips=3, window=4)
    reasons = [0, 1, 1, 3, 0, 2, 2, 2, 2, 0]
    sequence = [metrics(r) for r in reasons]
    eager = feed(monitor, sequence)
    jitted = feed(monitor, sequence, update=jax.jit(monitor.update))
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *sequence)
    scanned, _ = jax.jit(lambda s, ms: jax.lax.scan(lambda c, m: (monitor.update(c, m), None), s, ms))(
        monitor.init(), stacked)
    for other in (jitted, scanned):
        assert isinstance(other, MonitorState)
        assert all(bool(jnp.array_equal(a, b)) for a, b in zip(eager, other))
    assert eager.recent_reasons.tolist() == [2, 0, 2, 2] and int(eager.steps) == 10  # steps 8, 9, 6, 7
    assert int(eager.consecutive_skips) == 0 and int(eager.last_reason) == 2


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(max_consecutive_skips=0), ValueError,
     "`max_consecutive_skips`=0 is not allowed: expected a positive integer"),
    (dict(window=2.5), ValueError, "`window`=2.5 is not allowed: expected a positive integer"),
    (dict(max_skip_rate=1.5), ValueError, "`max_skip_rate`=1.5 is not allowed: expected a number in (0, 1]"),
    (dict(amp={"dtype": "float16"}), TypeError, "`amp`={'dtype': 'float16'} must be an AmpConfig or None"),
])
def test_bad_arguments(kwargs, error, fragment):
    with pytest.raises(error) as e:
        jaxamp.StallMonitor(**kwargs)
    assert fragment in str(e.value)
