"""Stall detection in the examples' training loop, with :class:`jaxamp.StallMonitor`.

The monitor counts every step inside the jitted chunk (its state is carried beside the
train state and saved in each checkpoint with it, so a resumed run behaves as an
uninterrupted one). A run stops *exactly* after ``training.max_consecutive_skips`` skipped
steps in a row: from then on the remaining steps of the chunk leave both states unchanged,
and the loop drops their records, prints the monitor's one-line diagnosis and ends (the
command exits with status 3). ``0`` never stops; the monitor's other signs of a stall (a high
skip rate over its window, a scale at its floor) are printed once as a warning.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

import jaxamp


NEVER = 2**31 - 1  # a number of consecutive skips no run reaches (int32)


def make_monitor(limit: int, amp: jaxamp.AmpConfig) -> jaxamp.StallMonitor:
    """The monitor for ``training.max_consecutive_skips=limit`` (0: never stop)."""
    return jaxamp.StallMonitor(max_consecutive_skips=limit or NEVER, amp=amp)


def monitored_step(step_fn, monitor: jaxamp.StallMonitor, stop: bool):
    """``((state, mstate), batch) -> ((state, mstate), metrics)``: one train step counted by the
    monitor. With ``stop``, a run that has reached the monitor's limit of consecutive skips
    stays where it is (both states unchanged)."""

    def step(carry: Tuple[Any, Any], batch: Any):
        state, mstate = carry
        new_state, metrics = step_fn(state, batch)
        new = (new_state, monitor.update(mstate, metrics))
        if stop:
            stalled = mstate.consecutive_skips >= monitor.max_consecutive_skips
            new = jax.tree_util.tree_map(lambda old, cur: jnp.where(stalled, old, cur), carry, new)
        return new, metrics

    return step


def stop_line(monitor: jaxamp.StallMonitor, mstate: Any, last_metrics: Mapping[str, Any], stop: bool) -> Optional[str]:
    """The diagnosis to stop on (None while the run goes on)."""
    if stop and int(mstate.consecutive_skips) >= monitor.max_consecutive_skips:
        return monitor.diagnose(mstate, last_metrics)
    return None
