"""Runs that speak: every example says where its outputs went and ends with a one-line verdict;
its plots read without help.

- ``examples.common.verdict``: ``trained`` only when steps were applied, the last applied loss is
  finite and the loss fell; otherwise ``stalled`` with the reason (all steps skipped, a
  non-finite loss, a loss that did not fall, the stall monitor's line);
- ``comparison.png``: the loss scale on its own axis (its -126 at an underflow leaves the
  derivative scales readable), no curve hidden (a style and marker per mode, fp32 on top, an
  equal curve named in the legend), the skipped steps in their own strip;
- ``profile.png``: every row says what it is, red bars say which edge they cross, a legend
  explains the colors and the rows, a run without derivative scalers says so;
- slow: an example CLI run whose every step is skipped prints its folder and a "stalled"
  verdict (exit status 0); the plain-fp16 port that skips every step says "stalled" too.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from examples.common.verdict import outputs_line, port_verdict, run_verdict, verdict

ROOT = Path(__file__).resolve().parents[1]


def test_the_verdict_says_trained_only_when_the_run_trained():
    assert verdict(3, 0, [5.0, 4.0, 3.0]).startswith("verdict: trained: 3 steps")
    assert verdict(3, 1, [5.0, "inf", 3.0], skipped_flags=[False, True, False]).startswith("verdict: trained")
    every = verdict(4, 4, ["nan"] * 4)
    assert every.startswith("verdict: stalled: all 4 steps skipped"), every
    assert verdict(3, 0, [5.0, 4.0, "nan"]).startswith("verdict: stalled: non-finite loss"), verdict(3, 0, [5.0, "nan"])
    assert verdict(3, 0, [5.0, 6.0, 7.0]).startswith("verdict: stalled: the loss did not fall")
    assert verdict(0, 0, []) == "verdict: stalled: no training step ran"
    line = verdict(9, 3, [1.0, 0.5], stalled="stalled at step 3: 3 skipped steps in a row,\n  scaler `1`")
    assert line == "verdict: stalled at step 3: 3 skipped steps in a row, scaler `1`"
    for v in (every, line):
        assert "\n" not in v


def test_a_port_whose_parameters_never_changed_is_stalled(tmp_path):
    import jax.numpy as jnp

    params = {"w": jnp.ones(3)}
    assert port_verdict(params, {"w": jnp.ones(3)}, [float("nan")] * 2, 5).startswith("verdict: stalled: all 5 steps")
    assert port_verdict(params, {"w": jnp.zeros(3)}, [2.0, 1.0], 5).startswith("verdict: trained")
    (tmp_path / "metrics.jsonl").write_text("")
    assert outputs_line(str(tmp_path)) == f"outputs: {tmp_path}{os.sep} (metrics.jsonl)"


def test_a_run_that_ends_stalled_without_being_stopped_is_stalled(tmp_path):
    # plain fp16 with training.max_consecutive_skips=0: its loss fell, then its loss scale sank
    # to the floor and its "applied" steps changed nothing; the monitor's diagnosis at the end decides
    recs = [{"step": i + 1, "loss": 1.0 / (i + 1), "skipped": i % 2 == 1} for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    line = "stalled at step 6: scale `loss` at its floor, the last for non-finite weight gradients"
    ended = run_verdict(str(tmp_path), {"steps": 6, "skipped_steps": 3, "stalled": None, "stalled_at_end": line})
    assert ended == "verdict: " + line
    healthy = run_verdict(str(tmp_path), {"steps": 6, "skipped_steps": 3, "stalled": None, "stalled_at_end": None})
    assert healthy.startswith("verdict: trained")


def _records(n, loss, loss_scale, derivative=None, skipped=None):
    out = []
    for i in range(n):
        r = {"step": i + 1, "loss": loss[i], "skipped": bool(skipped[i]) if skipped else False,
             "scale_log2/loss": loss_scale[i]}
        for k, v in (derivative or {}).items():
            r[f"scale_log2/{k}"] = v[i]
        out.append(r)
    return out


def _legend_texts(ax):
    legend = ax.get_legend()
    return [] if legend is None else [t.get_text() for t in legend.get_texts()]


def test_comparison_png_hides_no_curve_and_gives_the_loss_scale_its_own_axis(tmp_path):
    from examples.common.plots import comparison_figure, plot_comparison

    n = 300
    loss = list(100 * np.exp(-np.arange(n) / 50) + 0.1)  # fp32 and the scaler run: the same losses
    runs = {
        "fp32": _records(n, loss, [0.0] * n),
        "fp16_plain": _records(n, ["nan"] * n, [max(-126.0, 15.0 - i) for i in range(n)], skipped=[1] * n),
        "fp16_scaler_per_order": _records(n, loss, [15.0 - min(i, 7) for i in range(n)],
                                          {"1": [-3.0] * n, "2": [-8.0 + min(i // 50, 3) for i in range(n)]}),
    }
    fig = comparison_figure(runs, "synthetic")
    top, lscale, dscale, strip = fig.axes
    assert "loss scale" in lscale.get_ylabel() and "derivative" in dscale.get_ylabel()
    lo, hi = dscale.get_ylim()
    assert -10 < lo and hi < 0, (lo, hi)  # the loss scale's -126 is not on the derivative scales' axis
    assert lscale.get_ylim()[0] <= -126
    texts = _legend_texts(top)
    for mode in runs:
        assert any(t.startswith(mode) for t in texts), (mode, texts)
    assert any("same curve as" in t for t in texts), texts  # two equal loss curves: the legend says so
    assert any("fp16_plain" in t and "no finite loss" in t for t in texts), texts
    lines = [ln for ln in top.get_lines() if not ln.get_label().startswith("_") and "non-finite" not in ln.get_label()]
    styles = {(ln.get_linestyle(), ln.get_marker()) for ln in lines}
    assert len(styles) == len(lines) == 3  # a line style and marker per mode
    fp32 = next(ln for ln in lines if ln.get_label().startswith("fp32"))
    assert fp32.get_zorder() == max(ln.get_zorder() for ln in lines)  # drawn on top
    assert {t.get_text() for t in strip.get_yticklabels()} == set(runs)  # a row of skipped steps per mode
    assert any(t.startswith("fp16_scaler_per_order: key 1") for t in _legend_texts(dscale))
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert (Path(plot_comparison(str(tmp_path), runs)).stat().st_size > 0)


def test_profile_png_says_what_every_row_and_color_means(tmp_path):
    from jaxamp._src.core.window import Profile, value_range

    from examples.common.plots import PROFILE_COLORS, plot_profile, profile_figure

    rng = np.random.default_rng(0)
    inside = rng.uniform(1.0, 100.0, 1000)
    over, under = np.concatenate([inside, [1e5]]), np.concatenate([inside, np.full(50, 1e-6)])
    rng_of = lambda v: value_range(np.asarray(v, np.float32))  # noqa: E731
    prof = Profile(derivatives={"1": rng_of(under), "2": rng_of(inside)}, hidden={},
                   keys={"1": rng_of(inside), "2": rng_of(over)})
    fig = profile_figure(prof)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["key 1: derivatives it checks", "key 2: derivatives it checks",
                      "key 1: every value it scales", "key 2: every value it scales"]
    words = " ".join(t.get_text() for t in ax.texts + fig.texts)
    assert "overflow: max > 65504" in words and "underflow: p1 < 2^-14" in words  # each red bar says why
    assert "'derivatives it checks'" in words and "'every value it scales'" in words  # the rows explained
    legend = " ".join(t.get_text() for lg in fig.legends for t in lg.get_texts())
    for color, text in PROFILE_COLORS:
        assert text in legend
    assert "65504" in legend
    import matplotlib.pyplot as plt

    plt.close(fig)
    empty = profile_figure(Profile(derivatives={}, hidden={}, keys={}))
    assert "no derivative scaler" in " ".join(t.get_text() for t in empty.axes[0].texts)
    plt.close(empty)
    assert Path(plot_profile(str(tmp_path), prof)).stat().st_size > 0


TINY_BURGERS = ["model.layer_size=8", "model.nr_layers=2", "eval.grid=9", "training.chunk_steps=2",
                "training.checkpoint_every=2", "batch.initial=8", "batch.boundary=8", "batch.interior=16"]


@pytest.mark.slow  # an example CLI in a fresh process (compiles the step)
def test_an_example_that_skips_every_step_says_where_it_wrote_and_that_it_stalled(tmp_path):
    # derivative scales start at 2**30 and the stall monitor never stops: every step overflows
    args = [*TINY_BURGERS, "mode=fp16_scaler_per_order", "amp.default_max_scale_log2=30",
            "amp.derivative_scaler.init_scale=1073741824.0", "training.max_steps=4",
            "training.max_consecutive_skips=0", "eval.profile=false"]
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "examples.burgers", "--workdir", str(out), "--no-progress", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[-2].startswith(f"outputs: {out}{os.sep}") and "metrics.jsonl" in lines[-2], lines[-2:]
    assert lines[-1].startswith("verdict: stalled: all 4 steps skipped"), lines[-1]


@pytest.mark.slow  # the port compiles its step
def test_the_plain_fp16_port_that_skips_every_step_says_stalled(capsys):
    from examples.jax_user import fp16

    fp16.main(["--steps", "3", "--domain-scale", "0.02", "--plain-fp16"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verdict: stalled: all 3 steps skipped"), last
