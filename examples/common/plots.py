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
    """``scales.png``: log2 of every scaler against the step, skipped steps marked."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if recs:
        steps = np.array([r["step"] for r in recs])
        for k in [k for k in recs[0] if k.startswith("scale_log2/")]:
            ax.step(steps, [_num(r[k]) for r in recs], where="post", label=k.split("/", 1)[1])
        skipped = steps[np.array([bool(r["skipped"]) for r in recs])]
        if len(skipped):
            ymin = ax.get_ylim()[0]
            ax.plot(skipped, np.full(len(skipped), ymin), "r|", ms=12, label=f"skipped ({len(skipped)} steps)")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("log2 scale")
    ax.set_title("scalers")
    return _save(fig, workdir, "scales.png")


def plot_comparison(workdir: str, runs: Dict[str, str], title: str = "") -> str:
    """``comparison.png``: every mode of one seed on shared axes: the total loss (top; non-finite
    losses marked at the top edge) and every scaler in log2 (bottom; skipped steps marked).

    ``runs`` maps a mode name to its run folder (with ``metrics.jsonl``)."""
    import json

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    skips = []
    for i, (mode, run_dir) in enumerate(runs.items()):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        if not recs:
            continue
        color = f"C{i}"
        steps = np.array([r["step"] for r in recs])
        loss = np.array([_num(r["loss"]) for r in recs])
        top.plot(steps, np.where(np.isfinite(loss), loss, np.nan), color=color, lw=1, label=mode)
        bad = steps[~np.isfinite(loss)]
        if len(bad):
            top.plot(bad, np.full(len(bad), np.nanmax(np.where(np.isfinite(loss), loss, np.nan))), "|", color=color,
                     ms=10, label=f"{mode}: non-finite loss ({len(bad)} steps, first {bad[0]})")
        for j, k in enumerate(k for k in recs[0] if k.startswith("scale_log2/")):
            bottom.step(steps, [_num(r[k]) for r in recs], where="post", color=color, lw=1.2,
                        ls=("-", "--", ":", "-.")[j % 4], label=f"{mode}: {k.split('/', 1)[1]}")
        skips.append((mode, color, steps[np.array([bool(r["skipped"]) for r in recs])]))
    low, high = bottom.get_ylim()
    for i, (mode, color, skipped) in enumerate(s for s in skips if len(s[2])):
        y = low - (i + 1) * 0.04 * (high - low)  # one row of marks per mode, below the curves
        bottom.plot(skipped, np.full(len(skipped), y), "|", color=color, ms=6, label=f"{mode}: skipped ({len(skipped)})")
    top.set_yscale("log")
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
