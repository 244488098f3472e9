"""PNG plots of a finished run (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402


def _num(v: Any) -> float:
    return float(v) if not isinstance(v, str) else float("nan")


def plot_fields(workdir: str, inputs: Sequence[str], axes: Tuple[np.ndarray, np.ndarray],
                pred: Dict[str, np.ndarray], ref: Dict[str, np.ndarray]) -> str:
    """``fields.png``: per field, prediction | reference | |error| on the evaluation grid."""
    a0, a1 = axes
    fig, ax = plt.subplots(len(pred), 3, figsize=(12, 3.4 * len(pred)), squeeze=False)
    extent = (a0.min(), a0.max(), a1.min(), a1.max())
    for row, name in enumerate(pred):
        shape = (len(a0), len(a1))
        p, r = pred[name].reshape(shape), ref[name].reshape(shape)
        lo, hi = np.nanmin(r), np.nanmax(r)
        for col, (title, img, kw) in enumerate(
            ((f"{name} predicted", p, dict(vmin=lo, vmax=hi)), (f"{name} reference", r, dict(vmin=lo, vmax=hi)),
             (f"|{name} error|", np.abs(p - r), {}))
        ):
            im = ax[row, col].imshow(np.where(np.isfinite(img), img, np.nan).T, origin="lower", extent=extent,
                                     aspect="auto", cmap="viridis" if col < 2 else "magma", **kw)
            ax[row, col].set_title(title)
            ax[row, col].set_xlabel(inputs[0])
            ax[row, col].set_ylabel(inputs[1])
            fig.colorbar(im, ax=ax[row, col])
    return _save(fig, workdir, "fields.png")


# Colors of the loss terms (red, C3, marks non-finite losses) and of the scaler keys: the keys
# take a palette of their own (Dark2), so that comparison.png's mode colors (C0, C1, ...) and a
# key's color never read as the same thing; a key's color and dash depend on its place among
# the run's keys only (:func:`key_styles`), the same in every plot of that run.
_TERM_COLORS = ("C0", "C1", "C2", "C4", "C5", "C6", "C8", "C9", "C7")
KEY_COLORS = tuple(matplotlib.colormaps["Dark2"].colors) + ("#000080", "#808000")  # + navy, olive: 10
_KEY_DASHES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)))


def key_order(keys: Sequence[str]) -> List[str]:
    """Scaler keys in reading order: per-order keys by order (``1, 2, ...``), then per-term keys
    by their derivative order (``u, u__x, u__x__x``), then by name."""
    def rank(k: str):
        return (0, int(k), "") if k.isdigit() else (1, k.count("__"), k)

    return sorted(set(keys), key=rank)


def key_styles(keys: Sequence[str]) -> Dict[str, Tuple[Any, Any]]:
    """``{key: (color, line style)}``: a distinct pair per key (distinct colors for up to 10 keys,
    distinct pairs for up to 50), a function of the set of keys only, so every plot of a run
    (and comparison.png over several runs, given the union of their keys) draws a key alike."""
    n = len(KEY_COLORS)
    return {k: (KEY_COLORS[i % n], _KEY_DASHES[(i + i // n) % len(_KEY_DASHES)]) for i, k in enumerate(key_order(keys))}


def _legend_outside(ax, **kw):
    """The axes' legend to the right of its plot area, where it hides no data."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, **kw)


def smooth_log(y: np.ndarray, window: int) -> np.ndarray:
    """Centered rolling geometric mean of ``y`` over ``window`` steps, over the finite positive
    values only (NaN where a window has none): a loss curve on a log axis without its step-to-step
    noise."""
    y = np.asarray(y, np.float64)
    ok = np.isfinite(y) & (y > 0)
    logs = np.concatenate([[0.0], np.cumsum(np.where(ok, np.log(np.where(ok, y, 1.0)), 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    i = np.arange(len(y))
    lo, hi = np.clip(i - window // 2, 0, len(y)), np.clip(i - window // 2 + window, 0, len(y))
    n = counts[hi] - counts[lo]
    return np.where(n > 0, np.exp((logs[hi] - logs[lo]) / np.maximum(n, 1)), np.nan)


def losses_figure(recs: List[Dict[str, Any]]):
    """The figure of :func:`plot_losses` (returned open, for tests)."""
    fig, ax = plt.subplots(figsize=(10, 4.8))
    window = max(1, len(recs) // 25)
    if recs:
        steps = np.array([r["step"] for r in recs])
        terms = [k for k in recs[0] if k.startswith("terms/")]
        total = np.array([_num(r["loss"]) for r in recs])
        shown = lambda y: np.where(np.isfinite(y) & (y > 0), y, np.nan)  # noqa: E731
        # the total under the terms, dashed: a term that is nearly all of it stays visible on top
        ax.plot(steps, shown(total), color="0.55", lw=0.6, alpha=0.35, zorder=1)
        ax.plot(steps, smooth_log(total, window), color="k", ls="--", lw=1.3, zorder=2,
                label="total loss (drawn under the terms)")
        for j, k in enumerate(terms):
            y, color = np.array([_num(r[k]) for r in recs]), _TERM_COLORS[j % len(_TERM_COLORS)]
            ax.plot(steps, shown(y), color=color, lw=0.6, alpha=0.3, zorder=3)
            ax.plot(steps, smooth_log(y, window), color=color, lw=1.8, zorder=4, label=k.split("/", 1)[1])
        bad = steps[~np.isfinite(total)]
        ax.set_yscale("log")
        if len(bad):
            ax.plot(bad, np.full(len(bad), ax.get_ylim()[1]), "x", color="C3", clip_on=False, zorder=5,
                    label=f"non-finite loss ({len(bad)} steps)")
        _legend_outside(ax, title="term (weighted)", title_fontsize=8)
    else:
        ax.text(0.5, 0.5, "no steps recorded", transform=ax.transAxes, ha="center")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (log scale)")
    ax.set_title("loss per term: bold = rolling geometric mean over "
                 f"{window} step{'s' if window > 1 else ''}, faint = every step", fontsize=10)
    return fig


def plot_losses(workdir: str, recs: List[Dict[str, Any]]) -> str:
    """``losses.png``: each loss term and the total against the step, on a log axis. Each curve
    is drawn twice in its color: faint, every step; bold, its rolling geometric mean
    (:func:`smooth_log`, over a 25th of the run), so that step-to-step noise hides no term.
    The total is black and dashed, drawn under the terms (a term that is nearly all of the loss
    shows on top of it); non-finite losses are marked with red crosses on the top edge, with
    their count in the legend, which sits right of the plot."""
    return _save(losses_figure(recs), workdir, "losses.png")


def _integer_axis(ax) -> None:
    """Whole powers of two on a log2-scale axis, with some room around a constant curve."""
    lo, hi = ax.get_ylim()
    if hi - lo < 2:
        mid = round((lo + hi) / 2)
        ax.set_ylim(mid - 1.5, mid + 1.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def scales_figure(recs: List[Dict[str, Any]]):
    """The figure of :func:`plot_scales` (returned open, for tests)."""
    first = recs[0] if recs else {}
    scalers = [k.split("/", 1)[1] for k in first if k.startswith("scale_log2/") and k != "scale_log2/loss"]
    heads = [k.split("/", 1)[1] for k in first if k.startswith("headroom_log2/")]
    styles = key_styles(scalers + heads)
    panels = (["derivative"] if scalers else []) + ["loss"] + (["headroom"] if heads else [])
    ratios = {"derivative": 2.2, "loss": 1.4, "headroom": 2.0}
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.9 * len(panels) + 0.6), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [ratios[p] for p in panels]})
    ax_of = dict(zip(panels, axes[:, 0]))
    steps = np.array([r["step"] for r in recs])
    for panel, prefix in (("derivative", "scale_log2/"), ("headroom", "headroom_log2/")):
        if panel not in ax_of:
            continue
        ax, drawn = ax_of[panel], []
        for k in key_order(scalers if panel == "derivative" else heads):
            series = np.array([_num(r[prefix + k]) for r in recs])
            color, ls = styles[k]
            draw = ax.step if panel == "derivative" else ax.plot
            kw = dict(where="post") if panel == "derivative" else {}
            draw(steps, series, color=color, ls=ls, lw=1.4, label=f"key {k}{_same_as(series, drawn)}", **kw)
            drawn.append((f"key {k}", series))
    if "derivative" in ax_of:
        _integer_axis(ax_of["derivative"])
        ax_of["derivative"].set_ylabel("derivative scales, log2")
    lax = ax_of["loss"]
    if "scale_log2/loss" in first:
        series = np.array([_num(r["scale_log2/loss"]) for r in recs])
        none = " (none in this run: 2^0 throughout)" if not np.any(series) else ""  # fp32, bf16
        lax.step(steps, series, where="post", color="k", label=f"loss scale{none}")
        _integer_axis(lax)
    lax.set_ylabel("loss scale, log2")
    top = axes[0, 0]
    skipped = steps[np.array([bool(r["skipped"]) for r in recs], bool)] if recs else steps
    if len(skipped):  # along the bottom of the first panel
        top.plot(skipped, np.full(len(skipped), top.get_ylim()[0]), "|", color="C3", ms=12, clip_on=False,
                 label=f"skipped ({len(skipped)} steps)")
    if "headroom" in ax_of:
        low = ax_of["headroom"]
        low.axhline(0.0, color="C3", lw=1.6, alpha=0.8, label="overflow line (65504)")
        low.set_ylabel("headroom, log2\n(powers of two to 65504)")
    for panel, ax in ax_of.items():
        if ax.get_legend_handles_labels()[0]:
            _legend_outside(ax)
    note = "" if scalers else ": no derivative scaler in this run (profile.png: its headroom at scale 1)"
    top.set_title(f"scalers{note}", fontsize=10)
    axes[-1, 0].set_xlabel("step")
    return fig


def plot_scales(workdir: str, recs: List[Dict[str, Any]]) -> str:
    """``scales.png``: log2 of every derivative scaler against the step (a run without one has
    no such panel and says so in the title), skipped steps marked in red along the first panel's
    bottom; the loss scale (log2) on its own axis, so that its fall at an underflow (to about
    -126) does not squash the derivative scales; below, when the records have them, each key's
    headroom (``headroom_log2/<key>``: powers of two between its largest scaled derivative and
    65504; 0 is the overflow line). Each key has its color and dash (:func:`key_styles`) in both
    panels; a curve equal to one already drawn says so in the legend; legends sit right of the
    plots."""
    return _save(scales_figure(recs), workdir, "scales.png")


def _window_means(steps: np.ndarray, values: np.ndarray, n_windows: int = 200) -> Tuple[np.ndarray, np.ndarray]:
    """Mean of the finite values in each of ``n_windows`` consecutive windows (NaN where none)."""
    size = max(1, len(steps) // n_windows)
    centers, means = [], []
    for i in range(0, len(steps), size):
        chunk = values[i : i + size]
        ok = np.isfinite(chunk)
        centers.append(steps[i : i + size].mean())
        means.append(chunk[ok].mean() if ok.any() else np.nan)
    return np.array(centers), np.array(means)


# plot_comparison's per-mode styles: the first mode drawn widest and faint, the last thin on
# top, each with its own line style and marker, so that no curve hides another one.
_STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 1)), "P"))


def _mode_order(modes: Sequence[str]) -> List[str]:
    """Drawing order: fp32 last (on top, thinnest), the others as given."""
    return [m for m in modes if m != "fp32"] + [m for m in modes if m == "fp32"]


def _same_as(series: np.ndarray, drawn: List[Tuple[str, np.ndarray]]) -> str:
    """`` (same curve as X)`` when ``series`` equals an already drawn one (NaNs equal), else ''."""
    for name, other in drawn:
        if other.shape == series.shape and np.array_equal(other, series, equal_nan=True):
            return f" (same curve as {name})"
    return ""


def comparison_figure(runs: Dict[str, List[Dict[str, Any]]], title: str = ""):
    """The figure of :func:`plot_comparison` (returned open, for tests)."""
    modes = [m for m, recs in runs.items() if recs]
    colors = {m: f"C{i}" for i, m in enumerate(runs)}
    order = _mode_order(modes)
    n = max(1, len(order))
    keys = key_styles([k.split("/", 1)[1] for recs in runs.values() for k in (recs[0] if recs else {})
                       if k.startswith("scale_log2/") and k != "scale_log2/loss"])
    fig, (top, lscale, dscale, strip) = plt.subplots(
        4, 1, figsize=(12.5, 11.5), sharex=True, gridspec_kw={"height_ratios": [3.0, 1.7, 2.2, 0.5 + 0.3 * n]})
    drawn_loss: List[Tuple[str, np.ndarray]] = []
    drawn_ls: List[Tuple[str, np.ndarray]] = []
    drawn_ds: List[Tuple[str, np.ndarray]] = []
    bad_losses, any_ds = [], False
    for rank, mode in enumerate(order):
        recs, color = runs[mode], colors[mode]
        ls, marker = _STYLES[rank % len(_STYLES)]
        width = 1.2 + 2.4 * (n - 1 - rank) / max(1, n - 1)  # widest first, thinnest (fp32) last, on top
        alpha = 0.55 if rank < n - 1 else 1.0
        steps = np.array([r["step"] for r in recs])
        loss = np.array([_num(r["loss"]) for r in recs])
        x, y = _window_means(steps, loss)
        every = max(1, len(x) // 10)
        mark = dict(marker=marker, ms=6, markevery=(rank * every // n, every), mfc="none", mew=1.3)
        none = "" if np.isfinite(y).any() else " (no finite loss: nothing to draw)"
        top.plot(x, y, color=color, ls=ls, lw=width, alpha=alpha, zorder=2 + rank, **mark,
                 label=f"{mode}{none or _same_as(y, drawn_loss)}")
        drawn_loss.append((mode, y))
        bad_losses.append((mode, color, steps[~np.isfinite(loss)]))
        series = np.array([_num(r.get("scale_log2/loss", 0.0)) for r in recs])
        if "scale_log2/loss" in recs[0] and np.any(series):  # fp32, bf16: no loss scaler (2^0 throughout)
            lscale.step(steps, series, where="post", color=color, ls=ls, lw=width, alpha=alpha, zorder=2 + rank,
                        label=f"{mode}{_same_as(series, drawn_ls)}")
            drawn_ls.append((mode, series))
        every_s = max(1, len(steps) // 10)
        for k in key_order([k.split("/", 1)[1] for k in recs[0] if k.startswith("scale_log2/")
                            and k != "scale_log2/loss"]):  # a key's color, the mode's line style and marker
            series = np.array([_num(r["scale_log2/" + k]) for r in recs])
            name = f"{mode}: key {k}"
            dscale.step(steps, series, where="post", color=keys[k][0], lw=width, alpha=alpha, ls=ls,
                        marker=marker, ms=5, markevery=(rank * every_s // n, every_s), mfc="none", zorder=2 + rank,
                        label=f"{name}{_same_as(series, drawn_ds)}")
            drawn_ds.append((name, series))
            any_ds = True
        skipped = steps[np.array([bool(r["skipped"]) for r in recs])]
        row = len(order) - 1 - rank
        strip.plot(skipped, np.full(len(skipped), row), "|", color=color, ms=9, mew=1.2)
        strip.text(1.005, row, f"{len(skipped)}", transform=strip.get_yaxis_transform(), va="center", fontsize=8)
    top.set_yscale("log")
    low, high = top.get_ylim()
    for i, (mode, color, bad) in enumerate(b for b in bad_losses if len(b[2])):
        y = high * 10 ** (0.05 * (i + 1) * np.log10(high / low))  # one row of marks per mode, above the curves
        top.plot(bad, np.full(len(bad), y), "|", color=color, ms=6,
                 label=f"{mode}: non-finite loss ({len(bad)} steps, first {bad[0]})")
    top.set_ylabel("loss (window mean\nof the finite values)")
    _legend_outside(top, title="mode (fp32 drawn last, on top)", title_fontsize=8)
    top.set_title(title or "modes compared")
    lscale.set_ylabel("loss scale, log2")
    if drawn_ls:
        _legend_outside(lscale, title="loss scaler\n(fp32/bf16 have none)", title_fontsize=8)
    else:
        lscale.text(0.5, 0.5, "no loss scaler in these runs", transform=lscale.transAxes, ha="center", fontsize=9)
    dscale.set_ylabel("derivative scales, log2")
    if any_ds:
        _legend_outside(dscale, title="derivative scaler: color = key,\nline style = mode (as above)\n"
                        "(1, 2: per order; u__x ...: per term)", title_fontsize=8)
    else:
        dscale.text(0.5, 0.5, "no derivative scaler in these runs", transform=dscale.transAxes, ha="center",
                    fontsize=9)
    strip.set_yticks(range(len(order)), list(reversed(order)), fontsize=8)
    strip.set_ylim(-0.6, len(order) - 0.4)
    strip.set_ylabel("skipped\nsteps")
    strip.text(1.005, 1.02, "count", transform=strip.transAxes, fontsize=7)
    strip.set_xlabel("step")
    for ax in (lscale, dscale):
        _integer_axis(ax)  # log2 scales are whole powers of two
    return fig


def plot_comparison(workdir: str, runs: Dict[str, List[Dict[str, Any]]], title: str = "") -> str:
    """``comparison.png``: every mode of one seed on shared step axes, four panels. The loss:
    the mean of the finite values per window of steps (a window with only non-finite losses
    leaves a gap; those steps are marked along the top edge). The loss scale (log2) on its own
    axis: its fall to about -126 at an underflow does not squash the derivative scales. The
    derivative scales (log2): a color per key (:func:`key_styles`), the mode's line style and
    marker. The skipped steps, one row per mode, with their
    count. No curve hides another: each mode has its own line style and marker, the first drawn
    widest and fp32 last (thin, on top), and a curve equal to one already drawn says so in the
    legend ("same curve as ..."); the legends sit right of the plots.

    ``runs`` maps a mode name to that run's metric records (its ``metrics.jsonl``)."""
    return _save(comparison_figure(runs, title), workdir, "comparison.png")


def _save(fig, workdir: str, name: str, tight: bool = True) -> str:
    path = os.path.join(workdir, name)
    if tight:  # False: the figure placed its axes and legends itself
        fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")  # the legends right of the plots included
    plt.close(fig)
    return path


# plot_profile's colors: what each says about the drawn bar (1st percentile to max).
PROFILE_COLORS = (("C3", "red: the bar leaves the band (labelled: overflow or underflow)"),
                  ("C1", "orange: inside, but a few values below p1 under 2^-14"),
                  ("C0", "blue: p1 to max inside the band"))


def profile_color(r: Any) -> str:
    """The color of one range's bar in ``profile.png``: ``C3`` (red)
    exactly when the drawn bar leaves the band (its max above 65504 or its 1st percentile
    below 2^-14: ``headroom_up`` or ``headroom_down`` negative), ``C1`` (orange) when the bar
    is inside but a fraction of the values under the 1st percentile lies below 2^-14, else
    ``C0`` (blue)."""
    if float(r.headroom_up) < 0 or float(r.headroom_down) < 0:
        return "C3"
    return "C1" if float(r.frac_subnormal) > 0 else "C0"


def _profile_rows(prof: Any) -> List[Tuple[str, Any]]:
    """``(label, range)`` per bar: each key's checked derivatives, then every value it scales."""
    rows = [(f"key {k}: derivatives it checks", r) for k, r in prof.derivatives.items()]
    return rows + [(f"key {k}: every value it scales", r) for k, r in prof.keys.items()]


def profile_figure(prof: Any, scale_one: bool = False):
    """The figure of :func:`plot_profile` (returned open, for tests)."""
    from matplotlib.patches import Patch

    rows = _profile_rows(prof)
    plot_h, foot_h = 0.5 * max(len(rows), 2) + 1.3, 1.9  # inches: the bars, the legends under them
    height = plot_h + foot_h
    fig, ax = plt.subplots(figsize=(10.5, height))
    fig.subplots_adjust(left=0.22, right=0.86, top=1 - 0.55 / height, bottom=(foot_h + 0.1) / height)
    top = float(np.log2(65504.0))
    ax.axvspan(-14, top, color="C2", alpha=0.12)
    for i, (name, r) in enumerate(rows):
        p = np.asarray(r.log2_percentiles, np.float64)
        lo, mid, hi = float(p[0]), float(p[len(p) // 2]), float(r.log2_max)
        if not all(np.isfinite([lo, mid, hi])):
            ax.text(-14, i, " all zero / no values" if hi == -np.inf else " non-finite values", va="center", fontsize=8)
            continue
        ax.plot([lo, hi], [i, i], color=profile_color(r), lw=6, solid_capstyle="butt")
        ax.plot([mid], [i], "k.", ms=5)
        ax.text(1.02, i, f"{float(r.headroom_up):+.1f}", transform=ax.get_yaxis_transform(), va="center", fontsize=8,
                color="C3" if hi > top else "k")  # the headroom: powers of two from the max to 65504
        if hi > top:  # say which edge a red bar crosses: overflow is what skips steps
            ax.text(hi, i - 0.3, "overflow: max > 65504 (a step skips)", ha="right", va="bottom", fontsize=7,
                    color="C3")
        if lo < -14:
            ax.text(lo, i - 0.3, "underflow: p1 < 2^-14 (tiny values lost; often harmless)", ha="left",
                    va="bottom", fontsize=7, color="C3")
    if not rows:
        ax.text(0.5, 0.5, "no derivative scaler in this run (fp32, bf16 or plain fp16): nothing scaled to show",
                transform=ax.transAxes, ha="center", va="center", fontsize=9)
        ax.set_yticks([])
    else:
        ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
        ax.text(1.02, -0.7, "headroom\n(log2, max\nto 65504)", transform=ax.get_yaxis_transform(), va="bottom",
                fontsize=7.5)
        if prof.derivatives and prof.keys:  # the two groups of rows
            ax.axhline(len(prof.derivatives) - 0.5, color="0.6", lw=0.8)
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.8)
    ax.set_xlim(min(-16.0, ax.get_xlim()[0]), max(top + 2.0, ax.get_xlim()[1]))
    scale = "at scale 1" if scale_one else "times the key's scale"
    ax.set_xlabel(f"log2 |value| as float16 holds it ({scale}); bar: 1st percentile to max, dot: median")
    title = ("where each derivative scaler's values sit in float16's range, at the end of training" if not scale_one
             else "no derivative scaler in this run: where its derivatives sit in float16's range at scale 1,\n"
                  "at the end of training (the headroom is what a derivative scaler could use)")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color="C2", alpha=0.12, label="float16's normal range, 2^-14 to 65504")]
    handles += [Patch(color=c, label=text) for c, text in PROFILE_COLORS]
    keyed = ("rows: key K as a derivative scaler would group them" if scale_one
             else "rows: key K is a derivative scaler")
    rows_help = (f"{keyed} (per order: 1 = first derivatives, 2 = second ...; per term: "
                 "u__x ...).\n'derivatives it checks': the derivatives whose overflow check skips a step; "
                 "'every value it scales': those\nand the hidden float16 values of the passes its seed scales "
                 "(what the profile's recommend() fits a start scale to).")
    fig.legend(handles=handles, fontsize=7.5, loc="lower center", bbox_to_anchor=(0.5, 0.8 / height), ncol=2)
    fig.text(0.5, 0.12 / height, rows_help, ha="center", va="bottom", fontsize=7.5)
    return fig


def plot_profile(workdir: str, prof: Any, scale_one: bool = False) -> str:
    """``profile.png``: where each derivative and each scaler key sits in float16's window.

    ``prof`` is a result of :func:`jaxamp.profile` for the final parameters and scales; with
    ``scale_one`` (a run without derivative scalers: fp32, plain fp16, bf16), one at every scale
    1 with the keys a derivative scaler would have, so that the plot shows the headroom such a
    run has. One bar
    per scaler key's checked derivatives ("key K: derivatives it checks") and per key's every
    scaled value ("key K: every value it scales": those plus the hidden passes its seed
    scales), from the 1st percentile of its nonzero magnitudes to its largest (log2, scaled as
    float16 holds it), a dot at the median; right of each bar its headroom, the powers of two
    from its largest value to 65504 (negative: it overflows); the shaded band is float16's
    normal range, 2^-14 to 65504. Colors (:data:`PROFILE_COLORS`, :func:`profile_color`): red =
    the bar crosses the band, labelled with the edge it crosses (overflow above 65504, which
    skips steps; underflow of the 1st percentile below 2^-14, often harmless), orange = the bar
    is inside but some values below its 1st percentile are under 2^-14, blue = inside. A group
    with no nonzero value gets no bar, the words "all zero / no values" instead; an empty profile
    says the run has no derivative scaler. Under the plot, a legend of the colors and of the rows."""
    return _save(profile_figure(prof, scale_one), workdir, "profile.png", tight=False)
