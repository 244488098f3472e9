"""Stall detection for the examples' training loop.

The loop hands every chunk's metric records to :class:`StallWatch`; it prints one line when
the run looks stalled (the reason and what to try) and says when to stop:
``training.max_consecutive_skips`` skipped steps in a row (0: never stop). Its state is a
small pytree saved in each checkpoint beside the train state, so a resumed run stops at
exactly the step an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from examples.common.tensorboard import skip_reason_names

# What to try, per skip reason name (jaxamp.SKIP_* without the prefix, lower case).
ADVICE = {
    "derivative_overflow": "lower that scaler's max scale (amp.custom_max_scales_log2) or its init_scale, "
    "or use amp.mode=per_term_scaler",
    "nonfinite_grads": "lower the learning rate or optimizer.grad_clip_max_norm",
    "nonfinite_values": "the batch holds NaN/inf inputs or the network outputs are non-finite: check the data",
}


class StallWatch:
    """Counts consecutive skipped steps and names why they were skipped.

    Args:
      max_consecutive_skips: stop after this many skipped steps in a row; 0 never stops.
    """

    def __init__(self, max_consecutive_skips: int) -> None:
        self.limit = int(max_consecutive_skips)
        self.reasons = skip_reason_names()
        self.consecutive = 0
        self.stop_reason: Optional[str] = None
        self._last_reason: Optional[str] = None
        self._last_keys: List[str] = []

    def state(self) -> Dict[str, np.ndarray]:
        """The pytree saved in a checkpoint (see :meth:`restore`)."""
        return {"consecutive": np.asarray(self.consecutive, np.int32)}

    def restore(self, state: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> None:
        """Continue from a checkpoint's :meth:`state`; ``records`` are the metric records up to
        that step (the last skipped run of them names the reason)."""
        self.consecutive = int(np.asarray(state["consecutive"]))
        for rec in records[len(records) - self.consecutive:] if self.consecutive else ():
            self._note(rec)
        if self.limit and self.consecutive >= self.limit and records:  # it had stopped there
            self.stop_reason = self.line(int(records[-1]["step"]))

    def update(self, records: Sequence[Mapping[str, Any]]) -> Optional[str]:
        """Feed one chunk's records; returns the line to print and stop on, or None."""
        for rec in records:
            if rec["skipped"]:
                self.consecutive += 1
                self._note(rec)
            else:
                self.consecutive = 0
            if self.limit and self.consecutive >= self.limit and self.stop_reason is None:
                self.stop_reason = self.line(int(rec["step"]))
        return self.stop_reason

    def _note(self, rec: Mapping[str, Any]) -> None:
        self._last_reason = self.reasons.get(int(rec["skip_reason"]), "unknown")
        self._last_keys = [k.split("/", 1)[1] for k, v in rec.items() if k.startswith("found_inf/") and v]

    def line(self, step: int) -> str:
        """``stalled at step N: K skipped steps in a row, last for <reason>; try <advice>``."""
        why = (self._last_reason or "unknown").replace("_", " ")
        if self._last_reason == "derivative_overflow" and self._last_keys:
            why += " in scaler " + ", ".join(f"`{k}`" for k in self._last_keys)
        advice = ADVICE.get(self._last_reason or "", "see the metrics (metrics.jsonl)")
        return (
            f"stalled at step {step}: {self.consecutive} skipped steps in a row "
            f"(training.max_consecutive_skips={self.limit}), last for {why}; try: {advice}."
        )

