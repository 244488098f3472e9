"""PNG plots of a finished run (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
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


def plot_losses(workdir: str, recs: List[Dict[str, Any]]) -> str:
    """``losses.png``: total loss and each term against the step (log scale); non-finite marked."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if recs:
        steps = np.array([r["step"] for r in recs])
        keys = ["loss"] + [k for k in recs[0] if k.startswith("terms/")]
        for k in keys:
            y = np.array([_num(r[k]) for r in recs])
            ax.plot(steps, np.where(np.isfinite(y) & (y > 0), y, np.nan), label=k, lw=1 if k != "loss" else 1.6)
        bad = steps[~np.isfinite([_num(r["loss"]) for r in recs])]
        if len(bad):
            ax.plot(bad, np.full(len(bad), np.nanmax([_num(r["loss"]) for r in recs] + [1.0])), "rx",
                    label=f"non-finite loss ({len(bad)} steps)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_title("loss")
    return _save(fig, workdir, "losses.png")


def plot_scales(workdir: str, recs: List[Dict[str, Any]]) -> str:
    """``scales.png``: log2 of every scaler against the step, skipped steps marked; below it,
    when the records have them, each key's headroom (``headroom_log2/<key>``: powers of two
    between its largest scaled derivative and 65504; 0 is the overflow line)."""
    keys = [k for k in recs[0] if k.startswith("headroom_log2/")] if recs else []
    fig, axes = plt.subplots(2 if keys else 1, 1, figsize=(8, 7.5 if keys else 4.5), sharex=True, squeeze=False)
    ax = axes[0, 0]
    if recs:
        steps = np.array([r["step"] for r in recs])
        for k in [k for k in recs[0] if k.startswith("scale_log2/")]:
            ax.step(steps, [_num(r[k]) for r in recs], where="post", label=k.split("/", 1)[1])
        skipped = steps[np.array([bool(r["skipped"]) for r in recs])]
        if len(skipped):
            ymin = ax.get_ylim()[0]
            ax.plot(skipped, np.full(len(skipped), ymin), "r|", ms=12, label=f"skipped ({len(skipped)} steps)")
        ax.legend(fontsize=8)
    ax.set_ylabel("log2 scale")
    ax.set_title("scalers")
    if keys:
        low = axes[1, 0]
        for k in keys:
            low.plot(steps, [_num(r[k]) for r in recs], lw=0.8, label=k.split("/", 1)[1])
        low.axhline(0.0, color="r", lw=0.8, ls="--")
        low.set_ylabel("headroom, log2 (to 65504)")
        low.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    return _save(fig, workdir, "scales.png")


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


def plot_comparison(workdir: str, runs: Dict[str, List[Dict[str, Any]]], title: str = "") -> str:
    """``comparison.png``: every mode of one seed on shared axes. Top: the total loss, the mean
    of the finite values per window of steps (a window with only non-finite losses leaves a
    gap; those steps are marked along the top edge). Bottom: every active scaler in log2, with
    the skipped steps of each run marked below the curves.

    ``runs`` maps a mode name to that run's metric records (its ``metrics.jsonl``)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    skips, bad_losses = [], []
    for i, (mode, recs) in enumerate(runs.items()):
        if not recs:
            continue
        color = f"C{i}"
        steps = np.array([r["step"] for r in recs])
        loss = np.array([_num(r["loss"]) for r in recs])
        top.plot(*_window_means(steps, loss), color=color, lw=1.2, marker=".", ms=3,
                 label=f"{mode} (window mean of finite losses)")
        bad_losses.append((mode, color, steps[~np.isfinite(loss)]))
        for j, k in enumerate(k for k in recs[0] if k.startswith("scale_log2/")):
            series = [_num(r[k]) for r in recs]
            if k == "scale_log2/loss" and not any(series):
                continue  # loss scaler off (fp32, bf16): constant 2^0
            bottom.step(steps, series, where="post", color=color, lw=1.2, ls=("-", "--", ":", "-.")[j % 4],
                        label=f"{mode}: {k.split('/', 1)[1]}")
        skips.append((mode, color, steps[np.array([bool(r["skipped"]) for r in recs])]))
    top.set_yscale("log")
    low, high = top.get_ylim()
    for i, (mode, color, bad) in enumerate(b for b in bad_losses if len(b[2])):
        y = high * 10 ** (0.05 * (i + 1) * np.log10(high / low))  # one row of marks per mode, above the curves
        top.plot(bad, np.full(len(bad), y), "|", color=color, ms=6,
                 label=f"{mode}: non-finite loss ({len(bad)} steps, first {bad[0]})")
    low, high = bottom.get_ylim()
    for i, (mode, color, skipped) in enumerate(s for s in skips if len(s[2])):
        y = low - (i + 1) * 0.04 * (high - low)  # one row of marks per mode, below the curves
        bottom.plot(skipped, np.full(len(skipped), y), "|", color=color, ms=6, label=f"{mode}: skipped ({len(skipped)})")
    top.set_ylabel("loss")
    top.legend(fontsize=7)
    top.set_title(title or "modes compared")
    bottom.set_ylabel("log2 scale")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7, ncol=2)
    return _save(fig, workdir, "comparison.png")


def _save(fig, workdir: str, name: str) -> str:
    path = os.path.join(workdir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# plot_profile's colors: what each says about the drawn bar (1st percentile to max).
PROFILE_COLORS = (("C3", "bar crosses the band: values above 65504 or p1 below 2^-14"),
                  ("C1", "bar inside, but some values below p1 are under 2^-14"),
                  ("C0", "every nonzero value inside the band"))


def profile_color(r: Any) -> str:
    """The color of one :class:`jaxamp.window.Range`'s bar in ``profile.png``: ``C3`` (red)
    exactly when the drawn bar leaves the band (its max above 65504 or its 1st percentile
    below 2^-14: ``headroom_up`` or ``headroom_down`` negative), ``C1`` (orange) when the bar
    is inside but a fraction of the values under the 1st percentile lies below 2^-14, else
    ``C0`` (blue)."""
    if float(r.headroom_up) < 0 or float(r.headroom_down) < 0:
        return "C3"
    return "C1" if float(r.frac_subnormal) > 0 else "C0"


def plot_profile(workdir: str, prof: Any) -> str:
    """``profile.png``: where each derivative and each scaler key sits in float16's window.

    ``prof`` is a :class:`jaxamp.window.Profile` of the final parameters and scales. One bar
    per derivative and per scaler key, from the 1st percentile of its nonzero magnitudes to
    its largest (log2, scaled as float16 holds it), a dot at the median; the shaded band is
    float16's normal range, 2^-14 to 65504. Colors (:data:`PROFILE_COLORS`, :func:`profile_color`):
    red = the bar crosses the band, orange = the bar is inside but some values below its
    1st percentile are under 2^-14, blue = inside. A group with no nonzero value gets no bar,
    the words "all zero / no values" instead."""
    from matplotlib.patches import Patch

    rows = [(name, r) for name, r in prof.derivatives.items()] + [(f"scaler {k}", r) for k, r in prof.keys.items()]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 3.0))
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
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("log2 |value| as float16 holds it (scaled); bar: 1st percentile to max, dot: median")
    ax.set_title("derivative ranges at the end of training\nred: bar outside the shaded float16 band; "
                 "orange: inside, but values below p1 under 2^-14; blue: inside", fontsize=9)
    handles = [Patch(color="C2", alpha=0.12, label="float16 normal range, 2^-14 to 65504")]
    handles += [Patch(color=c, label=text) for c, text in PROFILE_COLORS]
    below = -0.6 / (0.45 * len(rows) + 1.2)  # about 0.6 inch under the axes, past the x label: no bar hidden
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, below), ncol=2)
    return _save(fig, workdir, "profile.png")
