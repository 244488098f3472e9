import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from tests.helpers.poisson import cached_problem, poisoned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_save_kill_restore_continue_is_bit_identical(tmp_path):
    """A worker process killed with SIGKILL after a save (a slow test: the subprocess compiles
    the step again); the fast suite checks an in-process save and resume
    (test_monitor_state_beside_the_train_state_resumes_bit_identical)."""
    total, cut = 12, 6
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint_worker", str(tmp_path / "ckpt"), str(cut)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert f"saved {cut}" in proc.stdout

    fresh, step, _, batch, _ = cached_problem("fp16")
    uninterrupted, skipped = fresh, []
    for i in range(total):
        uninterrupted, m = step(uninterrupted, batch(poisoned(i)))
        skipped.append(bool(m["skipped"]))

    ckpt = jaxamp.Checkpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == cut
    resumed = ckpt.restore(fresh)
    assert isinstance(resumed, jaxamp.TrainState) and int(resumed.step) == cut
    assert jax.tree_util.tree_structure(resumed) == jax.tree_util.tree_structure(fresh)
    for i in range(cut, total):
        resumed, _ = step(resumed, batch(poisoned(i)))
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), resumed, uninterrupted)
    assert all(jax.tree_util.tree_leaves(same))
    # the run skipped steps on both sides of the cut, so the skip logic is part of what matched
    assert any(skipped[:cut]) and any(skipped[cut:]) and not all(skipped)
    assert isinstance(resumed.amp_state.derivative, jaxamp._src.scaling.scaler.Scalers)


def test_restore_errors_and_keeping(tmp_path):
    state = cached_problem("fp16")[0]
    ckpt = jaxamp.Checkpointer(tmp_path / "c", max_to_keep=2)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore(state)
    for s in (1, 2, 3):
        ckpt.save(state, step=s)
    assert ckpt.all_steps() == [2, 3]
    with pytest.raises(FileNotFoundError, match="available steps: \\[2, 3\\]"):
        ckpt.restore(state, step=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        jaxamp.Checkpointer(tmp_path / "file")
    with pytest.raises(ValueError, match="`max_to_keep`=0"):
        jaxamp.Checkpointer(tmp_path / "d", max_to_keep=0)


@pytest.mark.slow  # an end-to-end run (fast-suite budget); CI runs it
def test_monitor_state_beside_the_train_state_resumes_bit_identical(tmp_path):
    """A stall monitor's state saved with the train state: the resumed run counts on as the
    uninterrupted one, and the Scalers container with its rules comes back."""
    fresh, step, _, batch, _ = cached_problem("fp16")
    monitor = jaxamp.StallMonitor(max_consecutive_skips=3, window=4, max_skip_rate=0.5)
    update = jax.jit(monitor.update)

    def run(carry, steps):
        for i in steps:
            state, m = step(carry["train"], batch(poisoned(i)))
            carry = {"train": state, "monitor": update(carry["monitor"], m)}
        return carry

    start = {"train": fresh, "monitor": monitor.init()}
    half = run(start, range(6))
    with jaxamp.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(half, step=6)
        resumed = ckpt.restore(start)
    assert resumed["train"].amp_state.derivative.rules == fresh.amp_state.derivative.rules
    a, b = run(resumed, range(6, 12)), run(half, range(6, 12))
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)))
    assert int(a["monitor"].steps) == 12 and int(jnp.sum(a["monitor"].recent_reasons != jaxamp.SkipReason.APPLIED)) >= 1


@pytest.mark.parametrize("change, fragment", [
    (lambda s: s.replace_amp(s.amp_state.replace(
        derivative=jaxamp.init(None, jaxamp.AmpConfig(), keys=["1"])().derivative)),
     "only in the checkpoint: ['opt_state.amp.derivative.2.growth_tracker', 'opt_state.amp.derivative.2.scale']"),
    (lambda s: s._replace(step=jnp.asarray(0.0)),
     "different shape or dtype: ['step (checkpoint int32[], like float32[])']"),
    (lambda s: s._replace(params={**s.params, "extra": jnp.zeros(2)}), "only in `like`: ['params.extra']"),
])
def test_restore_into_a_mismatched_state_names_the_leaves(tmp_path, change, fragment):
    state = cached_problem("fp16")[0]
    with jaxamp.Checkpointer(tmp_path / "m") as ckpt:
        ckpt.save(state, step=1)
        with pytest.raises(ValueError) as e:
            ckpt.restore(change(state))
    assert fragment in str(e.value) and "does not match `like`" in str(e.value)
