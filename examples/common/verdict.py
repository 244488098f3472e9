"""How every example run ends: where its outputs went, then a one-line verdict.

``verdict: trained ...`` or ``verdict: stalled: <reason>``. A run is *stalled* when the stall
monitor stopped it or diagnoses a stall at its end (e.g. the loss scale at its floor: the
gradients underflow, the "applied" steps change nothing), when no step ran, when every step was
skipped (the parameters never changed), when its last applied step's loss is not finite, or when
its loss did not fall; otherwise it *trained*. The exit status is the command's own business (a
plain fp16 run that skips every step may exit 0): the verdict is what says it did not train.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

Number = Any  # a float, or a string ("nan", "inf") as metrics.jsonl stores a non-finite one


def _float(v: Number) -> float:
    return float(v)  # float("nan"), float("inf") parse the strings metrics.jsonl writes


def _finite(v: Number) -> bool:
    return math.isfinite(_float(v))


def verdict(steps: int, skipped: int, losses: Sequence[Number], stalled: Optional[str] = None,
            skipped_flags: Optional[Sequence[bool]] = None) -> str:
    """The one-line verdict of a run of ``steps`` steps, ``skipped`` of them skipped.

    ``losses``: the loss of every step (or of the logged ones), in order; ``skipped_flags``:
    which of them were skipped (then the last *applied* step's loss is the one judged);
    ``stalled``: the stall monitor's reason, when it stopped the run."""
    if stalled:  # the monitor's line: "stalled at step N: ..."
        reason = " ".join(stalled.split())
        return "verdict: " + (reason if reason.startswith("stalled") else "stalled: " + reason)
    if steps <= 0:
        return "verdict: stalled: no training step ran"
    if skipped >= steps:
        return (f"verdict: stalled: all {steps} steps skipped (every update overflowed or was non-finite): "
                "the parameters never changed")
    losses = list(losses)
    flags = [False] * len(losses) if skipped_flags is None else list(skipped_flags)
    applied = [v for v, s in zip(losses, flags) if not s]
    bad = sum(not _finite(v) for v in losses)
    where = f", {skipped} skipped" if skipped else ""
    if not applied:
        return f"verdict: stalled: no loss recorded in {steps} steps{where}"
    if not _finite(applied[-1]):
        return (f"verdict: stalled: non-finite loss ({_float(applied[-1])}) at the end, "
                f"{bad} of {len(losses)} losses non-finite")
    finite = [_float(v) for v in losses if _finite(v)]
    first, last = finite[0], _float(applied[-1])
    if len(finite) > 1 and not last < first:
        return f"verdict: stalled: the loss did not fall ({first:.3e} -> {last:.3e}) in {steps} steps{where}"
    nonfinite = f", {bad} non-finite losses" if bad else ""
    return f"verdict: trained: {steps} steps{where}{nonfinite}, loss {first:.3e} -> {last:.3e}"


def run_verdict(workdir: str, summary: Mapping[str, Any]) -> str:
    """The verdict of an example run from its ``metrics.jsonl`` and ``summary.json`` values."""
    from examples.common.records import read_metrics

    recs = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    return verdict(int(summary.get("steps", len(recs))), int(summary.get("skipped_steps", 0)),
                   [r["loss"] for r in recs], stalled=summary.get("stalled") or summary.get("stalled_at_end"),
                   skipped_flags=[bool(r["skipped"]) for r in recs])


def outputs_line(workdir: str, names: Optional[Iterable[str]] = None) -> str:
    """``outputs: <absolute workdir>/ (what it holds)``: where a run's files went."""
    path = os.path.abspath(workdir)
    names = sorted(os.listdir(path)) if names is None and os.path.isdir(path) else list(names or [])
    shown = ", ".join(n + ("/" if os.path.isdir(os.path.join(path, n)) else "") for n in names)
    return f"outputs: {path}{os.sep}" + (f" ({shown})" if shown else "")


def port_verdict(params_before: Any, params_after: Any, losses: Sequence[float], steps: int) -> str:
    """The verdict of a user-written loop (examples/jax_user, examples/flax_user), from plain
    JAX values: the parameters before and after training and the logged losses. Parameters
    that never changed mean every step was skipped."""
    import jax
    import numpy as np

    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(params_before), jax.tree.leaves(params_after)))
    return verdict(steps, steps if same and steps > 0 else 0, losses)


def table_verdict(rows: List[Dict[str, Any]]) -> str:
    """One line over several runs (the demo): ``verdict: <mode> trained; <mode> stalled (...)``."""
    parts = []
    for r in rows:
        v = run_verdict(r["workdir"], r).removeprefix("verdict: ")
        head, _, reason = v.partition(": ")
        parts.append(f"seed {r['seed']} {r['mode']} " + (head if head == "trained" else f"stalled ({v})"))
    return "verdict: " + "; ".join(parts)
