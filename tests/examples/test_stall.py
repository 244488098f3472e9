"""The examples stop a stalled run: after training.max_consecutive_skips skipped steps in a row
they stop exactly there, say why, exit with status 3; kill + --resume stops at the same step."""

import pytest

from examples.burgers import Burgers
from examples.common.config import load_config
from examples.common.train import train_and_evaluate
from tests.helpers.examples import COMMON, TINY, read

# Derivative scales start at 2**30: float16 overflows at once, so the first steps are skipped
# (scaler `1` backs off by half per step; it needs ~14 steps to fit).
OVERFLOWING = ["mode=fp16_scaler_per_order", "amp.default_max_scale_log2=30",
               "amp.derivative_scaler.init_scale=1073741824.0"]


def cfg(steps, limit):
    return load_config("burgers", [*COMMON, *TINY[Burgers], *OVERFLOWING, f"training.max_steps={steps}",
                                   f"training.max_consecutive_skips={limit}"], checks=Burgers.checks)


@pytest.mark.slow  # end-to-end example runs; the monitor itself is tested fast in tests/test_monitor.py
def test_stalled_run_stops_exactly_and_resumes_to_the_same_stop(tmp_path):
    straight = train_and_evaluate(Burgers, cfg(9, 3), str(tmp_path / "a"), progress=False, plots=False)
    recs = read(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["skipped"] for r in recs)
    assert "stalled at step 3" in straight["stalled"] and "scaler `1`" in straight["stalled"]
    # Stopped at step 2 (a checkpoint), then resumed: the same records, the same stop.
    b = tmp_path / "b"
    train_and_evaluate(Burgers, cfg(2, 3), str(b), progress=False, plots=False)
    resumed = train_and_evaluate(Burgers, cfg(9, 3), str(b), resume=True, progress=False, plots=False)
    assert read(b / "metrics.jsonl") == recs and resumed["stalled"] == straight["stalled"]


@pytest.mark.slow  # end-to-end example runs; the monitor itself is tested fast in tests/test_monitor.py
def test_zero_never_stops(tmp_path):
    summary = train_and_evaluate(Burgers, cfg(5, 0), str(tmp_path), progress=False, plots=False)
    assert summary["stalled"] is None and len(read(tmp_path / "metrics.jsonl")) == 5


@pytest.mark.slow  # end-to-end example runs; the monitor itself is tested fast in tests/test_monitor.py
def test_cli_exits_with_status_3(tmp_path, capsys):
    from examples.common.main import main

    args = ["--workdir", str(tmp_path / "w"), "--no-progress", *COMMON, *TINY[Burgers], *OVERFLOWING,
            "training.max_steps=9", "training.max_consecutive_skips=3", "eval.profile=false"]
    assert main(Burgers, args) == 3
    assert "stalled at step 3" in capsys.readouterr().err
