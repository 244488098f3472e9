import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from tests.checkpoint_worker import poisoned
from tests.poisson import cached_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_kill_restore_continue_is_bit_identical(tmp_path):
    total, cut = 12, 6
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint_worker", str(tmp_path / "ckpt"), str(cut)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert f"saved {cut}" in proc.stdout

    fresh, step, _, batch, _ = cached_problem("fp16")
    uninterrupted = fresh
    for i in range(total):
        uninterrupted, _ = step(uninterrupted, batch(poisoned(i)))

    ckpt = jaxamp.Checkpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == cut
    resumed = ckpt.restore(fresh)
    assert isinstance(resumed, jaxamp.TrainState) and int(resumed.step) == cut
    assert jax.tree_util.tree_structure(resumed) == jax.tree_util.tree_structure(fresh)
    for i in range(cut, total):
        resumed, _ = step(resumed, batch(poisoned(i)))
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), resumed, uninterrupted)
    assert all(jax.tree_util.tree_leaves(same))
    # the run did skip steps and back scalers off, so the scaler states are part of what matched
    assert float(uninterrupted.deriv_scales["2"].scale) < 1.0


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
