"""How jaxamp's entry points (``scaled``, ``profile``, ``init``) trace a user's function: its
state and config located, the config active while tracing (``autocast`` without a config takes
it) and checked against the program's autocast policies, the passes of ``jaxamp.grad`` chains
shared."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp

from jaxamp._src.core import policy
from jaxamp._src.scaling.config import AmpConfig, ConfigError
from jaxamp._src.core.interpreter import holds, trace
from jaxamp._src.core.marks import AMP_OFF
from jaxamp._src.core.nesting import NO_DERIVATIVE, analyze
from jaxamp._src.core.rules import passes
from jaxamp._src.scaling.state import find

__all__ = ["check_amp", "shared_trace", "state_config", "traced"]


def shared_trace(fun: Callable, args, kwargs):
    """:func:`trace`, once, then the ``expand`` pass of every primitive of the rule table that
    the program holds (:func:`jaxamp._src.core.rules.passes`: the ``jaxamp.grad`` chains of each
    jaxpr that differentiate the same arguments computed by one plan)."""
    closed, flat, out_tree = trace(fun, args, kwargs)
    return expand(closed), flat, out_tree


def expand(closed: Any) -> Any:
    """``closed`` after the ``expand`` pass of every primitive of the rule table it holds."""
    for primitive, rewrite in passes():
        if holds(closed.jaxpr, frozenset((primitive,))):
            closed = rewrite(closed)
    return closed


def check_amp(amp, caller: str = "jaxamp.scaled") -> None:
    if amp is not None and not isinstance(amp, AmpConfig):
        raise TypeError(f"{caller}: `amp`={amp!r} must be an AmpConfig or None (per-order keys).")


def _is_scales(tree: Any) -> bool:
    """Whether ``tree`` is ``{key: scalar}`` scales (else a state, or a slip: params first)."""

    def scalar(v) -> bool:
        return isinstance(v, (int, float)) or (hasattr(v, "shape") and jnp.shape(v) == ())

    return isinstance(tree, Mapping) and all(isinstance(k, str) and scalar(v) for k, v in tree.items())


def state_config(scales: Any, amp: Optional[AmpConfig], caller: str):
    """``(amp, scales)`` of ``scales``: a mapping under ``amp``, or a state's own (an AmpState or
    an optimizer state holding one), which ``amp``, when given, must agree with."""
    if _is_scales(scales):
        return amp, scales
    state = find(scales, caller)
    if amp is not None and policy.Policy.of(amp).differences(state.amp):
        raise ConfigError(f"{caller}: `amp` has {policy.Policy.of(amp).describe()} but the `state` given has "
                          f"{policy.Policy.of(state.amp).describe()}; the state's config is the one used. Fix: drop "
                          "`amp` (the state carries its config) or build the state from the same AmpConfig.")
    return state.amp, state.scales


def traced(fun: Callable, args, kwargs, amp: Optional[AmpConfig], caller: str,
           against: str = "the config of the `state` (or `amp`) given", raw: bool = False):
    """:func:`shared_trace` with ``amp`` active (``autocast`` without a config takes it), the
    program's autocast policies checked against it; ``raw``: also the program as JAX traced it,
    before the passes (a fourth output)."""
    with policy.using(amp, caller) if amp is not None else contextlib.nullcontext():
        first, flat, out_tree = trace(fun, args, kwargs)
        closed = expand(first)
    if amp is not None:
        policy.check(policy.policies_in(closed), amp, caller, against)
    if amp is not None and not amp.off and (0, AMP_OFF) in analyze(
            closed.jaxpr, [NO_DERIVATIVE] * len(closed.jaxpr.invars)).marks:
        raise ConfigError(
            f"{caller}: the program holds a jaxamp derivative traced with AMP off (plain JAX, unscaled), "
            f"but runs with {policy.Policy.of(amp).describe()}: a jax.jit traced it under an AMP-off state "
            "and reuses that trace. Fix: jit the function once per config (e.g. build it inside a function "
            "of the config), or jax.clear_caches() before switching AMP on.")
    return (closed, flat, out_tree, first) if raw else (closed, flat, out_tree)
