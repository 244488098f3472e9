"""A run's records on disk: ``metrics.jsonl`` (one JSON record per step), the training time
per checkpoint (``train_time.json``), and the failure summary of a run's records."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

import jaxamp


def read_metrics(path: str, upto: Optional[int] = None) -> List[Dict[str, Any]]:
    """The records of ``path`` (up to step ``upto``); [] when there is no file."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if upto is None or r["step"] <= upto]


def write_metrics(path: str, recs: List[Dict[str, Any]], mode: str = "a") -> None:
    """Append (or with ``mode="w"`` write) records, one JSON line each."""
    with open(path, mode) as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def records_of(first_step: int, metrics: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """One record per step of a chunk's stacked metrics; non-finite floats as strings."""
    host = {k: np.asarray(v) for k, v in metrics.items()}
    n = len(host["loss"])
    out = []
    for i in range(n):
        rec: Dict[str, Any] = {"step": first_step + i + 1}
        for k, v in host.items():
            x = v[i].item()
            rec[k] = x if not isinstance(x, float) or math.isfinite(x) else str(x)
        out.append(rec)
    return out


def record_time(path: str, step: int, seconds: float) -> None:
    """Training seconds up to each checkpointed step, ``{step: seconds}``, replaced atomically."""
    times = {**read_json(path), str(step): seconds}
    with open(path + ".tmp", "w") as f:
        json.dump(times, f)
    os.replace(path + ".tmp", path)


def read_json(path: str) -> Dict[str, Any]:
    """A JSON file's object; {} when there is no file."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def failure_summary(recs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Steps where things went wrong: first non-finite loss, skipped steps, final scales."""
    def finite(v: Any) -> bool:
        return not isinstance(v, str) and math.isfinite(v)

    nonfinite = [r["step"] for r in recs if not finite(r["loss"])]
    skipped = [r["step"] for r in recs if r["skipped"]]
    out = {
        "steps": recs[-1]["step"] if recs else 0,
        "first_nonfinite_loss_step": nonfinite[0] if nonfinite else None,
        "nonfinite_loss_steps": len(nonfinite),
        "first_skipped_step": skipped[0] if skipped else None,
        "skipped_steps": len(skipped),
        "derivative_overflow_skips": sum(r["skip_reason"] == jaxamp.SkipReason.DERIVATIVE_OVERFLOW for r in recs),
    }
    if recs:
        out["final_scale_log2"] = {k.split("/", 1)[1]: recs[-1][k] for k in recs[-1] if k.startswith("scale_log2/")}
        out["min_scale_log2"] = {
            k.split("/", 1)[1]: min(r[k] for r in recs) for k in recs[-1] if k.startswith("scale_log2/")
        }
    return out
