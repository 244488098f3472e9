"""The examples' progress bar: ``skipped_total`` counts every skipped step of the run (across
chunks, and those of the records a resumed run started from), ``skipped_window`` the last
chunk's (``k/n``)."""

import io
import re

import pytest

from examples.common.train import _postfix, _progress_bar

CFG = {"name": "burgers", "mode": "fp16_scaler_per_order"}


def _recs(first, skipped):
    return [{"step": first + i, "loss": 1.0 / (first + i), "skipped": s, "scale_log2/loss": 16.0,
             "scale_log2/1": -2.0} for i, s in enumerate(skipped)]


def test_the_postfix_counts_the_skipped_steps_of_every_window():
    out = io.StringIO()
    earlier = _recs(1, [True, False, True])  # a resumed run: two skipped before it started
    bar = _progress_bar(True, 3, 12, CFG, earlier, file=out)
    bar.advance(_recs(4, [True, True, False]))
    bar.advance(_recs(7, [False, True, False]))
    assert bar.bar.n == 9
    assert "skipped_total=5" in bar.bar.postfix and "skipped_window=1/3" in bar.bar.postfix, bar.bar.postfix
    bar.advance(_recs(10, [False, False, False]))  # a clean window leaves the total
    assert "skipped_total=5" in bar.bar.postfix and "skipped_window=0/3" in bar.bar.postfix
    bar.close()
    assert re.search(r"skipped_total=5, skipped_window=0/3, s_loss=16, s_1=-2", out.getvalue()), out.getvalue()
    assert _progress_bar(False, 0, 5, CFG, []) is None


def test_postfix_fields():
    post = _postfix(_recs(1, [True, False]), 7)
    assert post == {"loss": 0.5, "skipped_total": 7, "skipped_window": "1/2", "s_loss": 16.0, "s_1": -2.0}


@pytest.mark.slow  # an end-to-end example run (compiles the step)
def test_a_run_shows_its_total_of_skipped_steps(tmp_path, capsys):
    from examples.burgers import Burgers
    from examples.common.config import load_config
    from examples.common.train import train_and_evaluate
    from tests.helpers.examples import COMMON, TINY, read

    # derivative scales start at 2**30: float16 overflows, the first steps skip (chunks of 2 steps)
    over = ["mode=fp16_scaler_per_order", "amp.default_max_scale_log2=30",
            "amp.derivative_scaler.init_scale=1073741824.0", "training.max_steps=6",
            "training.max_consecutive_skips=0"]
    cfg = load_config("burgers", [*COMMON, *TINY[Burgers], *over], checks=Burgers.checks)
    train_and_evaluate(Burgers, cfg, str(tmp_path), progress=True, plots=False)
    recs = read(tmp_path / "metrics.jsonl")
    total = sum(r["skipped"] for r in recs)
    assert total > 2  # more than one window's worth
    err = capsys.readouterr().err
    assert f"skipped_total={total}," in err, err[-2000:]
    assert f"skipped_window={sum(r['skipped'] for r in recs[-2:])}/2" in err
