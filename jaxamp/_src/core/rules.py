"""The rule table: how jaxamp's interpreters treat each primitive, keyed on the primitive object.

:data:`RULES` maps a ``jax.extend.core.Primitive`` to its :class:`PrimitiveRules`. JAX's own
higher-order primitives are listed here, with the evaluation rules of
:mod:`jaxamp._src.core.control`; each of jaxamp's primitives adds its entry in the module that
defines it, next to its JVP and batching rules (as JAX fills ``ad.primitive_jvps``), so a
primitive never exists without its rules:

* ``jaxamp_deriv_scale``, ``jaxamp_deriv_check`` (:mod:`jaxamp._src.core.marks`),
  ``jaxamp_policy`` (:mod:`jaxamp._src.core.policy`): their Taylor degree;
* ``jaxamp_boundary`` (:mod:`jaxamp._src.core.boundary`): a call, always inlined by ``evaluate``;
* ``jaxamp_chain`` (:mod:`jaxamp._src.derivatives.chain_call`): its program passes (``expand``,
  and ``off``: JAX's own derivatives with AMP off);
* ``jaxamp_scaled_dot`` (:mod:`jaxamp._src.placement.tensor_scale`): its held operands, its
  Taylor degree.

A primitive without an entry is evaluated as written (:func:`jaxamp._src.core.interpreter.bind`)
and, if it holds a mark in a body, rejected by name. ``import jaxamp`` imports every module that
defines a primitive, so the table is complete whatever was imported first
(tests/test_rule_table.py). The table is written at import time only, by module-level
statements (tests/test_no_ambient_state.py): nothing registers a rule while a program runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from jax._src.shard_map import shard_map_p  # not exported by jax.extend (JAX 0.10)
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

from jaxamp._src.core import control

__all__ = ["PrimitiveRules", "RULES", "NO_RULES", "rules_of", "evaluated", "passes", "held_operands"]


@dataclasses.dataclass(frozen=True)
class PrimitiveRules:
    """What jaxamp's interpreters do with one primitive's equations.

    Attributes:
      call: the parameter holding a body the interpreters inline, evaluated once as written
        (``jit``'s ``jaxpr``): :func:`jaxamp._src.core.interpreter.sub_jaxpr`.
      custom: the parameter holding a custom-derivative function's primal body (its rule is not
        kept): :func:`jaxamp._src.core.interpreter.custom_body`.
      wrapped: the parameter holding a body run in the primitive's own way (``jax.checkpoint``,
        ``shard_map``): analysed as a call's body (:mod:`jaxamp._src.core.nesting`), evaluated
        by ``evaluate`` only.
      evaluate: ``rule(eqn, invals, ctx, bodies) -> (outs, flags)`` for an equation whose
        bodies hold a mark (:func:`jaxamp._src.core.evaluate.evaluate`; rules in
        :mod:`jaxamp._src.core.control`).
      in_trace: ``evaluate`` runs in the caller's trace (a call inlined: its checks join the
        caller's); False: the body is traced on its own (a loop's, a branch's).
      inline: ``evaluate`` inlines the body even when it holds no mark (the network boundary:
        its derivatives were taken when the program was traced).
      expand: ``rewrite(closed) -> closed``, run on every program jaxamp's entry points trace
        that holds the primitive, before it is interpreted
        (:func:`jaxamp._src.core.tracing.traced`).
      off: ``rewrite(closed) -> closed``, run instead of ``expand`` on a program traced for a
        config with AMP off (``enabled=False`` or float32): the primitive's equations computed as
        JAX computes what they stand for (a ``jaxamp.grad`` chain: the nest of ``jax.grad``), so
        that AMP off is the user's program. The config reaches the program here, passed by the
        entry point, never through ambient state.
      held_operands: ``rule(*invals, **params) -> [(role, format name, operand as the format
        holds it)]``: the operands a profile reports against their format's window
        (:func:`jaxamp._src.core.profile.profile`).
      taylor: the primitive's degree in its ``x``-dependent operands for Taylor mode
        (:func:`jaxamp._src.taylor.rules.degree`): ``"constant"`` (0), ``"linear"`` (1) or
        ``"bilinear"`` (1 in one operand, 2 in two); JAX's primitives are listed by
        :mod:`jaxamp._src.taylor.rules` itself.
    """

    call: Optional[str] = None
    custom: Optional[str] = None
    wrapped: Optional[str] = None
    evaluate: Optional[Callable[..., Tuple[List[Any], Dict[str, Any]]]] = None
    in_trace: bool = False
    inline: bool = False
    expand: Optional[Callable[[jcore.ClosedJaxpr], jcore.ClosedJaxpr]] = None
    off: Optional[Callable[[jcore.ClosedJaxpr], jcore.ClosedJaxpr]] = None
    held_operands: Optional[Callable[..., List[Tuple[str, str, Any]]]] = None
    taylor: Optional[str] = None


NO_RULES = PrimitiveRules()

RULES: Dict[jcore.Primitive, PrimitiveRules] = {
    jp.jit_p: PrimitiveRules(call="jaxpr", evaluate=control.call, in_trace=True),
    jp.custom_jvp_call_p: PrimitiveRules(custom="call_jaxpr", evaluate=control.call, in_trace=True),
    jp.custom_vjp_call_p: PrimitiveRules(custom="call_jaxpr", evaluate=control.call, in_trace=True),
    jp.remat_p: PrimitiveRules(wrapped="jaxpr", evaluate=control.remat),
    shard_map_p: PrimitiveRules(wrapped="jaxpr", evaluate=control.shard_map),
    jp.scan_p: PrimitiveRules(evaluate=control.scan),
    jp.while_p: PrimitiveRules(evaluate=control.while_loop),
    jp.cond_p: PrimitiveRules(evaluate=control.cond),
}


def rules_of(primitive: jcore.Primitive) -> PrimitiveRules:
    """``primitive``'s entry of :data:`RULES`, else :data:`NO_RULES` (evaluated as written)."""
    return RULES.get(primitive, NO_RULES)


def evaluated() -> List[str]:
    """The names of the primitives ``evaluate`` can enter with a mark inside, sorted (for errors)."""
    return sorted(p.name for p, r in RULES.items() if r.evaluate is not None)


def passes(off: bool = False) -> List[Tuple[jcore.Primitive, Callable[[jcore.ClosedJaxpr], jcore.ClosedJaxpr]]]:
    """``[(primitive, rewrite)]`` of the program passes (``expand``; ``off``: the AMP-off ones), by
    primitive name (a fixed order)."""
    found = ((p, r.off if off else r.expand) for p, r in RULES.items())
    return sorted(((p, f) for p, f in found if f is not None), key=lambda e: e[0].name)


def held_operands() -> frozenset:
    """The primitives with a ``held_operands`` rule."""
    return frozenset(p for p, r in RULES.items() if r.held_operands is not None)
