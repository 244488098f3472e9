"""How jaxamp's entry points (``scaled``, ``profile``, ``init``) trace a user's function: its
state and config located, the program traced once whatever the config (nothing ambient: a trace
``jax.jit`` caches serves every config), then the config applied to it: its autocast policies
checked against it, and the program passes of the rule table run, those of AMP off when it is off
(``jaxamp.grad`` chains as JAX's own derivatives), else ``expand`` (the chains' passes shared)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp
from jax.extend import core as jcore

from jaxamp._src.core import policy
from jaxamp._src.scaling.config import AmpConfig, ConfigError
from jaxamp._src.core.interpreter import holds, trace
from jaxamp._src.core.marks import deriv_check_p
from jaxamp._src.core.rules import passes
from jaxamp._src.scaling.state import find

__all__ = ["check_amp", "expand", "state_config", "traced"]


def expand(closed: Any, off: bool = False) -> Any:
    """``closed`` after the ``expand`` pass (``off``: the AMP-off pass) of every primitive of the
    rule table it holds."""
    for primitive, rewrite in passes(off):
        if holds(closed.jaxpr, frozenset((primitive,))):
            closed = rewrite(closed)
    return closed


def live(closed: Any) -> Any:
    """``closed`` without the equations of its top level that no output reads (inputs kept; calls
    and loops kept whole): a derivative nobody reads is neither computed nor checked, as its
    overflow cannot make a result wrong. A check of a value the program computes for its
    outputs stays, whoever reads the check (the check of a first derivative whose second is
    returned: the second is computed from the first's scaled values), and so does a check whose
    own result nothing reads (written for its flag alone: an engine checks its scaled values and
    returns them unscaled)."""
    eqns, outs = closed.jaxpr.eqns, closed.jaxpr.outvars
    read = {v for v in outs if isinstance(v, jcore.Var)}
    read.update(v for eqn in eqns for v in eqn.invars if isinstance(v, jcore.Var))
    reads = {v for v in outs if isinstance(v, jcore.Var)}
    kept: set = set()
    while True:  # until no check of a value found live joins (its own operands may make more live)
        grown = False
        for k in range(len(eqns) - 1, -1, -1):
            eqn = eqns[k]
            if k in kept:
                continue
            check = eqn.primitive is deriv_check_p and eqn.params.get("check", True)
            if (eqn.effects or any(v in reads for v in eqn.outvars)
                    or (eqn.primitive is deriv_check_p and not any(v in read for v in eqn.outvars))
                    or (check and isinstance(eqn.invars[0], jcore.Var) and eqn.invars[0] in reads)):
                kept.add(k)
                grown = True
                reads.update(v for v in eqn.invars if isinstance(v, jcore.Var))
        if not grown:
            break
    if len(kept) == len(eqns):
        return closed
    return jcore.ClosedJaxpr(closed.jaxpr.replace(eqns=[eqns[k] for k in sorted(kept)]), closed.consts)


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
    """:func:`jaxamp._src.core.interpreter.trace` of ``fun``, its autocast policies checked against
    ``amp``, then the program passes for ``amp`` (AMP off: JAX's own derivatives); ``raw``: also
    the program as JAX traced it, before the passes (a fourth output)."""
    first, flat, out_tree = trace(fun, args, kwargs)
    if amp is not None:
        policy.check(policy.policies_in(first), amp, caller, against)
    closed = live(expand(first, off=amp is not None and amp.off))
    return (closed, flat, out_tree, first) if raw else (closed, flat, out_tree)
