"""The plots a newcomer reads (examples/common/plots.py), on synthetic records unless said:

- every legend sits outside the plot it explains (its box does not overlap the axes' box);
- ``losses.png``: each term drawn bold (rolling geometric mean) and faint (every step) in its own
  color, on a log axis, above the total (which is dashed, under the terms): a term that is nearly
  all of the loss stays visible; non-finite losses counted;
- ``scales.png`` and ``comparison.png``: a distinct color and dash per scaler key, the same in
  every panel and plot of a run; equal curves named; a run without derivative scalers gets no
  empty panel;
- ``profile.png`` of a run without derivative scalers (fp32, plain fp16): the profile at scale 1
  has its keys' ranges (the largest derivative of each order, as computed directly), the plot
  says "scale 1" and prints each bar's headroom.
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from examples.common import plots as P  # noqa: E402


def _records(n, terms, loss_scale=None, derivative=None, headroom=None, skipped=()):
    out = []
    for i in range(n):
        r = {"step": i + 1, "loss": float(sum(v[i] for v in terms.values())), "skipped": i in skipped}
        r.update({f"terms/{k}": float(v[i]) for k, v in terms.items()})
        if loss_scale is not None:
            r["scale_log2/loss"] = loss_scale
        r.update({f"scale_log2/{k}": float(v[i]) for k, v in (derivative or {}).items()})
        r.update({f"headroom_log2/{k}": float(v[i]) for k, v in (headroom or {}).items()})
        out.append(r)
    return out


def _assert_legends_outside(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        for legend in legends:
            lb = legend.get_window_extent(renderer)
            assert not box.overlaps(lb), (ax.get_ylabel(), [t.get_text() for t in legend.get_texts()])


def _lines(ax):
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def test_every_loss_term_is_visible_above_the_total_smoothed_on_a_log_axis():
    rng = np.random.default_rng(0)
    n = 400
    decay = np.exp(-np.arange(n) / 100)
    terms = {"pde": 10 * decay * rng.lognormal(0, 1.0, n),  # noisy, and nearly all of the loss
             "boundary": 1e-4 * (1 + decay) * rng.lognormal(0, 0.5, n)}  # four decades below it
    recs = _records(n, terms)
    recs[7]["loss"] = "nan"
    fig = P.losses_figure(recs)
    (ax,) = fig.axes
    assert ax.get_yscale() == "log"
    lines = _lines(ax)
    total = lines["total loss (drawn under the terms)"]
    assert total.get_linestyle() == "--"
    for k, raw in terms.items():
        bold = lines[k]
        assert bold.get_zorder() > total.get_zorder()
        y = np.asarray(bold.get_ydata(), float)
        assert np.isfinite(y).all() and np.min(y) > 0
        # the bold curve is the rolling mean: far less step-to-step noise than the steps themselves
        assert np.std(np.diff(np.log(y))) < 0.3 * np.std(np.diff(np.log(raw)))
        faint = [ln for ln in ax.get_lines() if ln.get_color() == bold.get_color() and ln is not bold]
        assert len(faint) == 1 and faint[0].get_alpha() < 0.5
        np.testing.assert_allclose(faint[0].get_ydata(), raw, rtol=1e-12)
    assert lines["pde"].get_color() != lines["boundary"].get_color()
    assert "non-finite loss (1 steps)" in lines
    _assert_legends_outside(fig)
    plt.close(fig)


def test_smooth_log_is_the_rolling_geometric_mean_of_the_finite_values():
    y = np.array([1.0, 4.0, np.nan, 16.0, 0.0, 64.0])
    np.testing.assert_allclose(P.smooth_log(y, 1), [1.0, 4.0, np.nan, 16.0, np.nan, 64.0])
    np.testing.assert_allclose(P.smooth_log(y, 3), [2.0, 2.0, 8.0, 16.0, 32.0, 64.0])


def test_key_styles_differ_per_key_and_do_not_depend_on_the_order_given():
    ldc = ["v__y", "u", "p", "u__x", "v", "u__y", "v__x"]  # the cavity's per-term keys
    styles = P.key_styles(ldc)
    assert len({c for c, _ in styles.values()}) == len(ldc)  # 7 keys, 7 colors
    assert P.key_styles(list(reversed(ldc))) == styles
    assert P.key_order(["2", "10", "1"]) == ["1", "2", "10"] and P.key_order(ldc)[:2] == ["p", "u"]
    ten = P.key_styles([f"k{i}" for i in range(10)])
    assert len({c for c, _ in ten.values()}) == 10
    many = P.key_styles([f"k{i}" for i in range(50)])
    assert len(set(many.values())) == 50  # colors repeat past 10, the (color, dash) pairs do not
    mode_colors = {to_rgba(f"C{i}") for i in range(10)}
    assert not {to_rgba(c) for c, _ in styles.values()} & mode_colors  # never a mode's color


def test_scales_png_draws_each_key_in_its_own_color_in_every_panel_with_legends_outside():
    n = 60
    keys = {"1": np.zeros(n), "2": np.zeros(n)}  # equal curves: the second one says so
    head = {"1": np.linspace(12, 14, n), "2": np.linspace(9, 10, n)}
    fig = P.scales_figure(_records(n, {"pde": np.ones(n)}, 16.0, keys, head, skipped={3, 40}))
    dscale, lscale, low = fig.axes
    d, h = _lines(dscale), _lines(low)
    assert d["key 1"].get_color() != d["key 2 (same curve as key 1)"].get_color()
    assert d["key 1"].get_linestyle() != d["key 2 (same curve as key 1)"].get_linestyle()
    assert h["key 1"].get_color() == d["key 1"].get_color()  # one color per key across the panels
    assert h["key 2"].get_color() == d["key 2 (same curve as key 1)"].get_color()
    assert "skipped (2 steps)" in d and "overflow line (65504)" in h
    _assert_legends_outside(fig)
    plt.close(fig)


def test_a_run_without_derivative_scalers_gets_no_empty_scales_panel():
    fig = P.scales_figure(_records(5, {"pde": np.ones(5)}, 16.0))
    (lscale,) = fig.axes
    assert "loss scale" in lscale.get_ylabel() and "no derivative scaler" in lscale.get_title()
    plt.close(fig)


def test_comparison_png_colors_keys_not_modes_in_the_derivative_panel():
    n = 50
    runs = {"fp32": _records(n, {"pde": np.linspace(2, 1, n)}, 0.0),
            "fp16_scaler_per_order": _records(n, {"pde": np.linspace(2, 1, n)}, 16.0,
                                              {"1": np.zeros(n), "2": np.full(n, -3.0)}),
            "fp16_scaler_per_term": _records(n, {"pde": np.linspace(2, 1, n)}, 16.0,
                                             {"u": np.zeros(n), "u__x": np.full(n, -2.0)})}
    fig = P.comparison_figure(runs)
    top, lscale, dscale, strip = fig.axes
    d = {k.split(" (")[0]: ln for k, ln in _lines(dscale).items()}
    colors = {k: to_rgba(ln.get_color()) for k, ln in d.items()}
    assert len(set(colors.values())) == 4  # four keys, four colors
    styles = P.key_styles(["1", "2", "u", "u__x"])
    assert colors["fp16_scaler_per_order: key 2"] == to_rgba(styles["2"][0])
    assert d["fp16_scaler_per_order: key 1"].get_linestyle() != d["fp16_scaler_per_term: key u"].get_linestyle()
    _assert_legends_outside(fig)
    plt.close(fig)


@pytest.mark.parametrize("mode", ["fp32", pytest.param("fp16_plain", marks=pytest.mark.slow)])  # one compile each
def test_the_profile_of_a_run_without_derivative_scalers_is_taken_at_scale_one(mode):
    """Its keys' ranges: the largest first and second derivatives, as the engine computes them at
    scale 1; the plot says scale 1 and prints each bar's headroom (powers of two below 65504)."""
    from examples.burgers import Burgers
    from examples.common.train import Setup
    from tests.helpers.examples import tiny

    setup = Setup(Burgers, tiny(Burgers, mode, 2))
    assert not setup.amp.scaler_enabled
    prof, scaled = setup.profile(setup.init_state())
    assert set(prof.derivatives) == {"1", "2"}
    for key, names in (("1", ("u__t", "u__x")), ("2", ("u__x__x",))):
        largest = max(np.abs(scaled[name]).max() for name in names)
        assert float(prof.derivatives[key].log2_max) == pytest.approx(np.log2(largest), abs=0.02)
    held = {"fp32": set(), "fp16_plain": {"1", "2"}}[mode]  # values held in float16: only plain fp16 has them
    assert set(prof.keys) == held
    fig = P.profile_figure(prof, scale_one=True)
    (ax,) = fig.axes
    assert "scale 1" in ax.get_title() and "at scale 1" in ax.get_xlabel()
    words = [t.get_text() for t in ax.texts]
    for r in prof.derivatives.values():
        assert f"{float(r.headroom_up):+.1f}" in words
    plt.close(fig)
