"""A stall detector any training loop can call on the step metrics or the optimizer's state
(docs/algorithm.md, "Training step"), and the stall report :func:`jaxamp.optimizer` makes itself.

A run is *stalled* when it keeps skipping (``max_consecutive_skips`` in a row, a skip rate above
``max_skip_rate`` over ``window`` steps) or a scale sits at its floor. Checkpoint the monitor's
state beside the train state so that a resumed run behaves as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Dict, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.core.marks import NONFINITE_VALUES
from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.scaling.scaler import SMALLEST_NORMAL
from jaxamp._src.training.step import SkipReason, find_opt_state

__all__ = [
    "ADVICE", "StallWarning", "StallError", "explain", "stall_line", "report_stall", "opt_state_metrics",
    "MonitorState", "StallMonitor"
]

ADVICE = {
    SkipReason.NONFINITE_VALUES: (
        "bad values (non-finite inputs, network outputs or loss)",
        "no scale can cure them: check the data for NaN/inf points, the parameters for NaN and the loss's own "
        "terms (data, source terms) for values beyond float16's range: compute them in float32",
    ),
    SkipReason.DERIVATIVE_OVERFLOW: (
        "overflow in derivative scaler {keys}",
        "rescale the problem (non-dimensional inputs and outputs) so that its derivatives fit "
        "float16, or lower that scaler's max scale (amp.custom_max_scales_log2), or use amp.dtype: bfloat16",
    ),
    SkipReason.NONFINITE_GRADS: (
        "non-finite weight gradients",
        "lower the learning rate, clip the gradients ({clip}) or lower amp.loss_scaler.init_scale",
    ),
    SkipReason.NONFINITE_UPDATES: (
        "non-finite new values from finite gradients",
        "check the learning rate, the loss weights and the optimizer's hyper-parameters for NaN/inf",
    ),
}


class StallWarning(RuntimeWarning):
    """A run skipped ``max_consecutive_skips`` steps in a row (:func:`jaxamp.optimizer`)."""


class StallError(RuntimeError):
    """A run skipped ``max_consecutive_skips`` steps in a row, with ``on_stall="raise"``."""


# skipped steps in a row that make a stall, unless told otherwise (jaxamp.optimizer, make_train_step, StallMonitor)
STALL_LIMIT = 100

# the loss scale this low and the weight gradients still non-finite: the overflow is not theirs
FLOOR_LOG2 = -24


def explain(reason: int, keys: list, *, loss_scale_log2: Optional[float] = None, derivative_keys: tuple = ()):
    """``(cause, advice)`` of a skip reason, read against the state: the one home of the stall advice.

    Non-finite weight gradients with the loss scale at or below ``2**FLOOR_LOG2`` did not overflow in
    their own backward pass: with no derivative scaler (``derivative_keys`` empty) the likely cause
    is a derivative of the float16 network in the loss, cured by derivative scaling."""
    cause, advice = ADVICE.get(reason, ("unknown skip reason", "see docs/algorithm.md"))
    cause = cause.format(keys=", ".join(f"`{k}`" for k in keys) or "(none flagged in the last step)")
    advice = advice.format(clip="optax.clip_by_global_norm inside jaxamp.optimizer(optax.chain(...)); "
                           "make_train_step: grad_clip_max_norm")
    if reason == SkipReason.NONFINITE_VALUES and not derivative_keys:
        advice += ("; if the loss takes derivatives of a float16 network, turn derivative scaling on "
                   "(jaxamp.AmpConfig(), derivative_scaling=True): an overflowing derivative makes the loss non-finite")
    if reason == SkipReason.NONFINITE_GRADS and loss_scale_log2 is not None and loss_scale_log2 <= FLOOR_LOG2:
        cause = f"non-finite weight gradients with the loss scale already at 2**{loss_scale_log2:g}"
        advice = ("the overflow is in the loss, not in the gradients' backward pass: "
                  + ("turn derivative scaling on (jaxamp.AmpConfig(), derivative_scaling=True) if the loss takes "
                     "derivatives of the network, and " if not derivative_keys else "")
                  + "check the loss's own terms (data, source terms) for values beyond float16's range "
                  "(non-dimensionalize the problem) or use amp.dtype: bfloat16")
    return cause, advice


def stall_line(caller: str, n: int, limit: int, reason: int, keys: list, *, loss_scale_log2: Optional[float] = None,
               derivative_keys: tuple = ()) -> str:
    """The one line a stall is reported with: the count, the reason, what to try (:func:`explain`)."""
    cause, advice = explain(reason, keys, loss_scale_log2=loss_scale_log2, derivative_keys=derivative_keys)
    return (f"{caller}: training stalled: {n} consecutive skipped steps (max_consecutive_skips={limit}), the last "
            f"for {cause}. Try: {advice}. The count and reason are in the optimizer's state (consecutive_skips, "
            "skip_reason): jaxamp.StallMonitor().update(mstate, opt_state) reads them.")


def report_stall(consecutive_skips: jax.Array, skip_reason: jax.Array, found_inf: Mapping[str, jax.Array], *,
                 limit: int, on_stall: str, caller: str, loss_scale: Optional[jax.Array] = None) -> None:
    """Warn (``on_stall="warn"``: a :class:`StallWarning`) or raise (``"raise"``: a
    :class:`StallError`, surfacing from the step as a JAX runtime error) when
    ``consecutive_skips`` reaches a multiple of ``limit``: a host callback inside a ``lax.cond``
    taken only then, so a run that does not stall makes no host call.
    """

    def say(n: Any, reason: Any, flags: Mapping[str, Any], scale: Any) -> None:
        n = int(n)
        if n == 0 or n % limit:  # under vmap the cond is a select and this runs every step
            return
        line = stall_line(caller, n, limit, int(reason), [k for k, v in flags.items() if bool(v)],
                          loss_scale_log2=None if scale is None else float(np.log2(scale)),
                          derivative_keys=tuple(k for k in flags if k != NONFINITE_VALUES))
        if on_stall == "raise":
            raise StallError(line)
        warnings.warn(line, StallWarning, stacklevel=2)

    hit = (consecutive_skips > 0) & (consecutive_skips % limit == 0)
    jax.lax.cond(hit, lambda: jax.debug.callback(say, consecutive_skips, skip_reason, dict(found_inf), loss_scale),
                 lambda: None)


def opt_state_metrics(opt_state: Any) -> Dict[str, jax.Array]:
    """The metrics :meth:`StallMonitor.update` and :meth:`StallMonitor.diagnose` read, from the
    state of :func:`jaxamp.optimizer` (or any optimizer state holding it)."""
    opt = find_opt_state(opt_state)
    if opt is None:
        raise TypeError(f"jaxamp.StallMonitor: `metrics`={type(opt_state).__name__} must be the step's metrics (a "
                        "mapping with 'skipped' and 'skip_reason') or an optimizer state holding one AmpOptState "
                        "(from jaxamp.optimizer), e.g. monitor.update(mstate, opt_state).")
    reason = jnp.asarray(opt.skip_reason, jnp.int32)
    out = {"skipped": reason != int(SkipReason.APPLIED), "skip_reason": reason}
    if opt.amp is not None:  # log2 of the scales, powers of two: exact
        out["scale_log2/loss"] = jnp.log2(opt.amp.loss_scale)
        out.update({f"scale_log2/{k}": jnp.log2(v) for k, v in opt.amp.scales.items()})
    return out


class MonitorState(NamedTuple):
    """The stall detector's state: a pytree of arrays (checkpoint it with the train state)."""

    steps: jax.Array  # i32[]: steps seen
    consecutive_skips: jax.Array  # i32[]: skipped steps in a row, up to the last one seen
    recent_reasons: jax.Array  # i32[window]: skip reason of the last `window` steps (ring buffer)
    last_reason: jax.Array  # i32[]: the skip reason of the last skipped step


@dataclasses.dataclass(frozen=True, kw_only=True)
class StallMonitor:
    """Detects a run that keeps skipping steps, and says why.

    Args:
      max_consecutive_skips: this many skipped steps in a row is a stall (default 100).
      window: the number of recent steps the skip rate is taken over (default 1000).
      max_skip_rate: a skip rate above this over a full window is a stall, in ``(0, 1]``.
      amp: the settings, for each scale's floor (``min_scale``); None: the floor 2**-126.

    In a training loop (not run here: needs a train state, a step and a batch)::

        mstate = monitor.init()
        state, metrics = step(state, batch)
        mstate = monitor.update(mstate, metrics)
        if (line := monitor.diagnose(mstate, metrics)):
            raise SystemExit(line)

    Example (two steps skipped for key ``"2"``, with hand-made metrics):
      >>> import jaxamp
      >>> monitor = jaxamp.StallMonitor(max_consecutive_skips=2, window=10)
      >>> metrics = {"skipped": True, "skip_reason": jaxamp.SkipReason.DERIVATIVE_OVERFLOW, "found_inf/2": True}
      >>> mstate = monitor.update(monitor.init(), metrics)
      >>> print(monitor.diagnose(mstate, metrics))
      None
      >>> mstate = monitor.update(mstate, metrics)
      >>> print(monitor.diagnose(mstate, metrics))  # doctest: +ELLIPSIS
      jaxamp: training stalled at step 2: 2 consecutive skipped steps, the last for overflow in derivative ...
    """

    max_consecutive_skips: int = STALL_LIMIT
    window: int = 1000
    max_skip_rate: float = 0.5
    amp: Optional[AmpConfig] = None

    def __post_init__(self) -> None:
        for name, kind, ok, allowed in (("max_consecutive_skips", int, lambda v: v >= 1, "a positive integer"),
                                        ("window", int, lambda v: v >= 1, "a positive integer"),
                                        ("max_skip_rate", (int, float), lambda v: 0 < v <= 1, "a number in (0, 1]")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
                raise ValueError(f"StallMonitor: `{name}`={value!r} is not allowed: expected {allowed}.")
        if self.amp is not None and not isinstance(self.amp, AmpConfig):
            raise TypeError(f"StallMonitor: `amp`={self.amp!r} must be an AmpConfig or None.")

    def init(self) -> MonitorState:
        """The state before the first step."""
        zero = jnp.asarray(0, jnp.int32)  # also SkipReason.APPLIED, the last reason before any skip
        return MonitorState(zero, zero, jnp.zeros((self.window,), jnp.int32), zero)

    def update(self, state: MonitorState, metrics: Mapping[str, Any]) -> MonitorState:
        """Count one step. Pure: works inside ``jit``/``lax.scan`` or outside.

        Args:
          state: the monitor's state.
          metrics: the step's metrics (``skipped`` and ``skip_reason`` are read), or the state of
            :func:`jaxamp.optimizer` (or any optimizer state holding it) after the step.

        Returns:
          The new state.
        """
        metrics = metrics if isinstance(metrics, Mapping) else opt_state_metrics(metrics)
        skipped = jnp.asarray(metrics["skipped"], bool)
        reason = jnp.where(skipped, jnp.asarray(metrics["skip_reason"], jnp.int32), SkipReason.APPLIED)
        return MonitorState(
            steps=state.steps + 1,
            consecutive_skips=jnp.where(skipped, state.consecutive_skips + 1, 0),
            recent_reasons=state.recent_reasons.at[state.steps % self.window].set(reason),
            last_reason=jnp.where(skipped, reason, state.last_reason),
        )

    def floor_log2(self, key: str) -> float:
        """``log2`` of the floor of the scale ``key`` (``"loss"`` for the loss scaler)."""
        if self.amp is None:
            return math.log2(SMALLEST_NORMAL)
        rule = self.amp.make_loss_scaler() if key == "loss" else self.amp.derivative_scaler_for(key)
        return math.log2(rule.floor if rule is not None else SMALLEST_NORMAL)

    def diagnose(self, state: MonitorState, metrics: Mapping[str, Any]) -> Optional[str]:
        """One line naming why the run stalls and what to try, or None while it does not.

        Args:
          state: the monitor's state after the latest step.
          metrics: the latest step's metrics (for the flags and the scales), or the optimizer's state.

        Returns:
          The line, or None.
        """
        metrics = metrics if isinstance(metrics, Mapping) else opt_state_metrics(metrics)
        def group(g: str) -> Dict[str, np.ndarray]:  # {key: host value} of the metrics "<g>/<key>"
            return {k[len(g) + 1:]: np.asarray(v) for k, v in metrics.items() if k.startswith(g + "/")}

        steps, run, reasons = int(state.steps), int(state.consecutive_skips), np.asarray(state.recent_reasons)
        floors = [k for k, v in group("scale_log2").items() if float(v) <= self.floor_log2(k)]
        if run >= self.max_consecutive_skips:
            what, reason = f"{run} consecutive skipped steps", int(state.last_reason)
        elif steps >= self.window and np.mean(reasons != SkipReason.APPLIED) > self.max_skip_rate:
            skips = reasons[reasons != SkipReason.APPLIED]
            reason = int(np.bincount(skips).argmax())
            what = f"{len(skips)} of the last {self.window} steps skipped"
        elif floors:
            what = f"scale {', '.join(f'`{k}`' for k in floors)} at its floor"
            reason = SkipReason.NONFINITE_GRADS if floors == ["loss"] else SkipReason.DERIVATIVE_OVERFLOW
        else:
            return None
        flagged = [k for k, v in group("found_inf").items() if bool(v)]
        keys = flagged or [k for k in floors if k != "loss"]
        scales = group("scale_log2")
        loss_log2 = float(scales["loss"]) if "loss" in scales else None
        cause, advice = explain(reason, keys, loss_scale_log2=loss_log2, derivative_keys=tuple(k for k in scales
                                                                                               if k != "loss"))
        return f"jaxamp: training stalled at step {steps}: {what}, the last for {cause}. Try: {advice}."
