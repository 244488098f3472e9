"""TensorBoard event files of a run, beside ``metrics.jsonl`` (``tensorboardX``).

Every numeric field of a step's metric record becomes a scalar under its own tag: the loss
and ``terms/<term>``, ``scale_log2/<key>`` for every scaler (``loss``, ``1``, ``2``, term
names), ``found_inf/<key>``, ``headroom_log2/<key>`` (powers of two between each key's
largest scaled derivative and 65504, ``make_train_step(headroom=True)``), ``grad_norm``,
``skipped``, ``skip_reason`` and any other field the train step reports. Skip reasons are also
counted by name, ``skips/<reason>`` (the running number of steps skipped for that reason). At the
end of a run with plots, the derivative ranges of :func:`jaxamp.profile` are added under
``profile/``, and a histogram of each derivative's log2 magnitudes under ``log2_abs/``. View with
``tensorboard --logdir <workdir>/tensorboard``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Dict, Iterable, Mapping

import numpy as np

import jaxamp

SUBDIR = "tensorboard"


def skip_reason_names() -> Dict[int, str]:
    """``{code: name}`` of the train step's skip reasons (``jaxamp.SkipReason``), e.g.
    ``{1: "derivative_overflow", 2: "nonfinite_grads"}``."""
    return {int(r): r.name.lower() for r in jaxamp.SkipReason if r != jaxamp.SkipReason.APPLIED}


class TensorBoardLog:
    """Writes metric records as TensorBoard scalars in ``<workdir>/tensorboard``.

    Args:
      workdir: the run's folder.
      first_step: the step the run continues from (0 for a new run). On ``--resume``,
        TensorBoard drops the events a dead run wrote after this step (``purge_step``).
      skip_counts: the running count per skip reason up to ``first_step`` (from the
        records kept in ``metrics.jsonl``), so the ``skips/*`` curves continue.
    """

    def __init__(self, workdir: str, first_step: int = 0, skip_counts: Mapping[str, int] = ()) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:  # an optional dependency of the examples
            raise jaxamp.ConfigError(
                "training.tensorboard=true needs tensorboardX: pip install -e '.[examples]' "
                "(or pass training.tensorboard=false)."
            ) from e
        self.logdir = os.path.join(workdir, SUBDIR)
        self.reasons = skip_reason_names()
        self.counts = {name: 0 for name in self.reasons.values()}
        self.counts.update(dict(skip_counts))
        # Non-finite losses are data here (plain fp16 runs have many): no warning per value.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        # The event file's name holds the wall time in whole seconds: a run resumed within the
        # same second would overwrite the dead run's file. A nanosecond suffix keeps both files
        # and sorts the resumed one after it (TensorBoard reads files in name order).
        self.writer = SummaryWriter(
            self.logdir,
            purge_step=first_step + 1 if first_step else None,
            filename_suffix=f".{time.time_ns()}",
        )

    def write(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Add one scalar per numeric field of each record (non-finite values as NaN/inf)."""
        for rec in records:
            step = int(rec["step"])
            for tag, value in rec.items():
                if tag == "step":
                    continue
                x = _number(value)
                if x is not None:
                    self.writer.add_scalar(tag, x, step)
            reason = self.reasons.get(int(rec.get("skip_reason", 0)))
            if reason is not None:
                self.counts[reason] += 1
            for name, n in self.counts.items():
                self.writer.add_scalar(f"skips/{name}", n, step)
        self.writer.flush()

    def write_profile(self, step: int, prof: Any, scaled: Mapping[str, Any]) -> None:
        """A derivative profile at ``step``: as scalars ``profile/scaler_<key>/{log2_max,headroom_up,
        headroom_down}`` each key's range in float16 (``prof.keys``, from :func:`jaxamp.profile`),
        ``profile/<derivative>/log2_max`` the largest magnitude of each derivative's values times its
        key's scale (``scaled``), and a histogram of ``log2 |value|`` per derivative,
        ``log2_abs/<derivative>`` (zeros and non-finite values left out)."""
        for key, r in prof.keys.items():
            for field in ("log2_max", "headroom_up", "headroom_down"):
                self.writer.add_scalar(f"profile/scaler_{key}/{field}", float(getattr(r, field)), step)
        for name, values in scaled.items():
            mags = np.abs(np.asarray(values, np.float64)).ravel()
            mags = mags[np.isfinite(mags) & (mags > 0)]
            if mags.size:
                self.writer.add_scalar(f"profile/{name}/log2_max", float(np.log2(mags.max())), step)
                self.writer.add_histogram(f"log2_abs/{name}", np.log2(mags), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def skip_counts(records: Iterable[Mapping[str, Any]]) -> Dict[str, int]:
    """Steps skipped per reason name in ``records`` (the ``skips/*`` totals)."""
    reasons = skip_reason_names()
    counts = {name: 0 for name in reasons.values()}
    for rec in records:
        name = reasons.get(int(rec.get("skip_reason", 0)))
        if name is not None:
            counts[name] += 1
    return counts


def _number(value: Any):
    """A float for TensorBoard, or None for a field that is not a number. Records store
    non-finite floats as the strings "nan", "inf", "-inf" (JSON has no such numbers)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            x = float(value)
        except ValueError:
            return None
        return x if not math.isfinite(x) else None
    return None
