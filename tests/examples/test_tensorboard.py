"""The examples' TensorBoard event files, read back with TensorBoard's own reader."""

import math

import pytest

from examples.burgers import Burgers
from examples.common.tensorboard import skip_reason_names
from examples.common.train import train_and_evaluate
from tests.helpers.examples import read, tiny

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(logdir):
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def histograms(logdir):
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.HISTOGRAMS: 0})
    acc.Reload()
    return {tag: [(e.step, e.histogram_value) for e in acc.Histograms(tag)] for tag in acc.Tags()["histograms"]}


@pytest.mark.slow  # an end-to-end run of an example
def test_event_files_hold_every_metric_of_every_step(tmp_path):
    # Derivative scales start at 2**30: the scaled derivatives overflow float16 at once, so
    # the first steps are skipped (and counted under skips/<reason>).
    cfg = tiny(Burgers, "fp16_scaler_per_order", 4)
    cfg["amp"] = {**cfg["amp"], "default_max_scale_log2": 30, "derivative_scaler": {"init_scale": 2.0**30}}
    train_and_evaluate(Burgers, cfg, str(tmp_path), progress=False)
    recs = read(tmp_path / "metrics.jsonl")
    tb = scalars(tmp_path / "tensorboard")
    # The final profile: each scaler key's range as float16 holds it, and its plot.
    assert [s for s, _ in tb["profile/scaler_2/log2_max"]] == [4]
    assert (tmp_path / "profile.png").stat().st_size > 0
    reasons = skip_reason_names()
    tags = ["loss", "terms/burgers", "scale_log2/loss", "scale_log2/1", "scale_log2/2", "skip_reason", "found_inf/2"]
    for tag in tags + [f"skips/{name}" for name in reasons.values()]:
        assert tag in tb, (tag, sorted(tb))
    for tag in tags:
        assert [s for s, _ in tb[tag]] == [1, 2, 3, 4]
        for (_, got), rec in zip(tb[tag], recs):
            want = float(rec[tag])
            assert got == pytest.approx(want, rel=1e-6) or (math.isnan(got) and math.isnan(want)), (tag, got, want)
    assert recs[0]["skipped"]
    for code, name in reasons.items():
        counted = [v for _, v in tb[f"skips/{name}"]]
        assert counted == [sum(r["skip_reason"] == code for r in recs[:i]) for i in range(1, 5)], name


@pytest.mark.slow
def test_resume_drops_the_dead_runs_later_events(tmp_path):
    """A run stopped at step 2 and resumed to 4 reads back as one run of 4 steps, with the
    final derivative profile's histograms. Slow: two end-to-end runs (the fast suite writes
    and reads back one, test_event_files_hold_every_metric_of_every_step)."""
    train_and_evaluate(Burgers, tiny(Burgers, "fp32", 2), str(tmp_path), progress=False, plots=False)
    train_and_evaluate(Burgers, tiny(Burgers, "fp32", 4), str(tmp_path), resume=True, progress=False)
    recs = read(tmp_path / "metrics.jsonl")
    tb = scalars(tmp_path / "tensorboard")
    assert [s for s, _ in tb["loss"]] == [1, 2, 3, 4]
    assert [v for _, v in tb["loss"]] == pytest.approx([r["loss"] for r in recs], rel=1e-6)
    hist = histograms(tmp_path / "tensorboard")
    assert set(hist) == {"log2_abs/u__t", "log2_abs/u__x", "log2_abs/u__x__x"}
    step, value = hist["log2_abs/u__x__x"][0]
    # One value per point of the batch (8 initial, 8 boundary, 16 interior); the scalar
    # log2_max is the largest of them.
    assert step == 4 and value.num == 8 + 8 + 16
    assert value.max == pytest.approx(tb["profile/u__x__x/log2_max"][0][1], abs=1e-3)


@pytest.mark.slow  # a second end-to-end run
def test_tensorboard_off_writes_no_event_files(tmp_path):
    cfg = tiny(Burgers, "fp32", 2)
    cfg["training"] = {**cfg["training"], "tensorboard": False}
    train_and_evaluate(Burgers, cfg, str(tmp_path), progress=False, plots=False)
    assert not (tmp_path / "tensorboard").exists()


def test_a_run_resumed_within_the_same_second_keeps_the_dead_runs_events(tmp_path, monkeypatch):
    """Event files are named by the wall time in whole seconds; with the clock held still the
    resumed run's file must neither overwrite the first run's nor sort before it."""
    from examples.common.tensorboard import TensorBoardLog

    monkeypatch.setattr("time.time", lambda: 1_700_000_000.5)
    first = TensorBoardLog(str(tmp_path), 0)
    first.write([{"step": s, "loss": float(s)} for s in (1, 2, 3)])
    first.close()
    resumed = TensorBoardLog(str(tmp_path), 2)
    resumed.write([{"step": s, "loss": 10.0 * s} for s in (3, 4)])
    resumed.close()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    assert scalars(tmp_path / "tensorboard")["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
