"""The one interpreter of the marks (:func:`evaluate`).

``evaluate`` runs a jaxpr equation by equation (checkify-style, :func:`jaxamp._src.core.interpreter.eval_jaxpr`):
every ``deriv_scale_p`` becomes the current scale of its key (:class:`Context`), every
``deriv_check_p`` adds its flags; an equation whose sub-jaxprs hold a mark goes to its
primitive's ``evaluate`` rule in the rule table (:data:`jaxamp._src.core.rules.RULES`: call
bodies inlined, loops, branches, ``jax.checkpoint`` and ``shard_map`` rebuilt by
:mod:`jaxamp._src.core.control`). What one evaluation knows (the scales, the pending checks,
the analyses of its jaxprs) lives in its :class:`Context`, passed down to the rules.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.core.control import full_flags
from jaxamp._src.core.interpreter import bind, eval_jaxpr, holds, sub_jaxprs
from jaxamp._src.core.marks import (NONFINITE_VALUES, PRIMITIVES, deriv_check_p, deriv_scale_p, merge_found_inf,
                                    or_into, reduce_flags, scaler_key, step_flags)
from jaxamp._src.core.nesting import NO_DERIVATIVE, Analyses, Info
from jaxamp._src.core.rules import evaluated, rules_of

__all__ = ["full_flags", "evaluate", "inputs", "marks_in", "Context", "Recorder", "ordered", "opaque"]

Flags = Dict[str, jax.Array]


def marks_in(jaxpr: jcore.Jaxpr, cache: Optional[Dict[Any, bool]] = None) -> bool:
    """Whether ``jaxpr`` or one of its sub-jaxprs holds a jaxamp mark (``cache``: as
    :func:`jaxamp._src.core.interpreter.holds`)."""
    return holds(jaxpr, PRIMITIVES, cache)


def inputs(jaxpr: jcore.Jaxpr) -> List[Info]:
    """The infos of a traced function's arguments: no derivative (:mod:`jaxamp._src.core.nesting`)."""
    return [NO_DERIVATIVE] * len(jaxpr.invars)


class Context:
    """The scales and the key rule of one evaluation."""

    def __init__(self, scales: Mapping[str, Any], amp: Optional[AmpConfig]) -> None:
        self.amp = amp
        # the nesting analyses of this evaluation's jaxprs and which of them hold marks, computed
        # once each (shared with the contexts of its bodies: in_body copies the references)
        self.analyses = Analyses()
        self.holds: Dict[Any, bool] = {}
        self.active = amp is None or amp.scaler_enabled
        self.scales = opaque(scales) if self.active else {}
        # {key: f32[]} the largest |scaled derivative| checked under each key (the headroom's
        # peak); None inside loop, branch, remat and shard_map bodies (their own traces)
        self.peaks: Optional[Dict[str, jax.Array]] = {}
        # {key: [per-point flags]} of this trace's checks, inlined bodies' too; reduced once by
        # the outermost evaluate
        self.pending: Optional[Dict[str, List[jax.Array]]] = None
        # recording mode (jaxamp.profile): evaluates every equation through the recorder, which
        # sees each checked derivative and each equation's outputs
        self.recorder: Optional[Recorder] = None

    def evaluate(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                 infos: Sequence[Info]) -> Tuple[List, Flags]:
        """A body under this context: :func:`evaluate` (what the ``evaluate`` rules call)."""
        return evaluate(jaxpr, consts, args, self, infos)

    def in_body(self) -> "Context":
        """This context for a body traced on its own (a loop's, a branch's)."""
        inner = copy.copy(self)
        inner.peaks, inner.pending = None, None
        return inner

    def key(self, order: int, term: Optional[str]) -> str:
        return scaler_key(self.amp, order, term)

    def keys(self, jaxpr: jcore.Jaxpr, infos: Sequence[Info]) -> List[str]:
        """The flag keys ``jaxpr`` produces with inputs of ``infos`` (static)."""
        if not self.active:
            return []
        marked = self.analyses(jaxpr, infos).marks
        keys = ordered(self.key(o, t) for o, t in marked if o > 0)
        return keys + [NONFINITE_VALUES] if marked else []

    def scale(self, shape: Tuple[int, ...], order: int, term: Optional[str]) -> jax.Array:
        """The scale of ``(order, term)``'s key as float32 of ``shape`` (the mark's output)."""
        if not self.active:
            if str(order) in self.scales:  # plain fp16: scale 1 through the scaled graph
                return jnp.broadcast_to(self.scales[str(order)], shape)
            return jnp.ones(shape, jnp.float32)  # fp32, bf16, AMP off: nothing multiplies
        key = self.key(order, term)
        if key not in self.scales:
            raise KeyError(
                f"jaxamp.scaled: the program takes a derivative with scaler key {key!r} (order {order}, "
                f"term {term!r}) but `scales` has only the keys {sorted(self.scales)}; pass a scale for "
                f"every key of jaxamp.init(fun, amp)(*args) (AmpState.scales)."
            )
        return jnp.broadcast_to(jnp.asarray(self.scales[key], jnp.float32), shape)


class Recorder:
    """What :func:`evaluate` calls in recording mode (``Context.recorder``): ``bind`` evaluates
    an equation without a mark, ``derivative`` sees a checked derivative of a key, ``outputs``
    every equation's outputs."""

    def bind(self, eqn: jcore.JaxprEqn, invals: List[Any]) -> List[Any]:
        return bind(eqn, invals)

    def derivative(self, eqn: jcore.JaxprEqn, key: str, g: Any) -> None:
        pass

    def outputs(self, eqn: jcore.JaxprEqn, outs: List[Any]) -> None:
        pass


def ordered(keys) -> List[str]:
    """Keys once each: per-order keys by order, then named keys as they appear."""
    keys = list(dict.fromkeys(keys))
    return sorted((k for k in keys if k.isdigit()), key=int) + [k for k in keys if not k.isdigit()]


def opaque(scales: Mapping[str, Any], dtype: Any = jnp.float32) -> Dict[str, jax.Array]:
    """The scales (or the flags, ``dtype=bool``) through one optimisation barrier: XLA compiles the
    same graph for any values, so a program at scale 1 with its flags clear is bit-identical to
    it with scaling off."""
    if not scales:
        return {}
    keys = list(scales)
    stacked = jax.lax.optimization_barrier(jnp.stack([jnp.asarray(scales[k], dtype) for k in keys]))
    return {k: stacked[i] for i, k in enumerate(keys)}


def check(ctx: Context, g, v, order: int, term: Optional[str]) -> None:
    """Appends this check's per-point flags to ``ctx.pending[key]``."""
    if not ctx.active:
        return
    pending = ctx.pending
    finite_v = jnp.isfinite(v)
    if order > 0:
        key = ctx.key(order, term)
        pending.setdefault(key, []).append(step_flags(g, finite_v))
        if ctx.peaks is not None and jnp.size(g):
            peak = jnp.max(jnp.abs(g)).astype(jnp.float32)
            ctx.peaks[key] = peak if key not in ctx.peaks else jnp.maximum(ctx.peaks[key], peak)
    # Bad values: a checked value (order 0) or a first derivative's value (a network output)
    # is not finite. Above order 1 a non-finite value below was flagged by the step below.
    if order <= 1:
        pending.setdefault(NONFINITE_VALUES, []).append(~finite_v)


def evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx: Context,
             infos: Sequence[Info], literal: Callable[[Any], Any] = lambda x: x) -> Tuple[List, Flags]:
    """The one interpreter of the marks: ``jaxpr`` on ``args`` with every ``deriv_scale_p`` its
    key's scale from ``ctx`` and every ``deriv_check_p``'s flags collected; ``(outs, found_inf)``.
    In recording mode (``ctx.recorder``) the recorder evaluates the other equations and sees
    the checked derivatives (:func:`jaxamp.profile`)."""
    flags: Flags = {}
    owner = ctx.pending is None  # the outermost evaluation of this trace reduces the checks
    pending = ctx.pending = {} if owner else ctx.pending
    analysis = ctx.analyses(jaxpr, infos)
    recorder = ctx.recorder

    def rule(eqn, invals):
        outs = marked(eqn, invals)
        if recorder is not None:
            recorder.outputs(eqn, outs)
        return outs

    def marked(eqn, invals):
        prim = eqn.primitive
        if prim is deriv_scale_p:
            return [ctx.scale(eqn.outvars[0].aval.shape, *analysis.resolved[eqn])]
        if prim is deriv_check_p:
            order, term = analysis.resolved[eqn]
            if eqn.params["check"]:
                check(ctx, *invals, order, term)
                if recorder is not None and order > 0:  # order 0: a value check
                    recorder.derivative(eqn, ctx.key(order, term), invals[0])
            return [invals[0]]
        rules = rules_of(prim)
        # the network boundary (rules.inline): its derivatives were taken when the program was
        # traced, so its body is inlined; else the fast path when nothing of ours is inside
        if not rules.inline and not any(marks_in(j, ctx.holds) for j in sub_jaxprs(eqn)):
            return bind(eqn, invals) if recorder is None else recorder.bind(eqn, invals)
        if rules.evaluate is None:
            raise NotImplementedError(
                f"jaxamp.scaled: jaxamp.grad inside a `{prim.name}` is not supported; supported "
                f"are {evaluated()}. Move the jaxamp.grad call out of it."
            )
        body_ctx = ctx if rules.in_trace else ctx.in_body()  # an inlined body's checks join this trace's
        outs, sub_flags = rules.evaluate(eqn, invals, body_ctx, analysis.bodies[eqn])
        for k, v in sub_flags.items():
            or_into(flags, k, v)
        return outs

    outs = eval_jaxpr(jaxpr, consts, args, rule, literal=literal)
    if owner:
        ctx.pending = None
        flags = merge_found_inf(flags, reduce_flags(pending))
    return outs, flags
