"""``jaxamp._src.core.scaled``: scales in, overflow flags out, for programs using ``dropin.grad``.

``scaled(fun, amp)(scales, *args) -> (fun(*args), found_inf)`` traces ``fun`` to a jaxpr
and evaluates it with :func:`jaxamp._src.core.interpreter.eval_jaxpr` (checkify-style): every
``deriv_scale_p`` becomes the current scale of its key, every ``deriv_check_p`` ORs its
flags into ``found_inf``. The result is an ordinary JAX function of ``(scales, *args)``: it
composes with ``jax.grad``, ``vmap``, ``jit``, ``jacrev``/``jacfwd`` and ``lax.scan``.

``found_inf[key]`` is a true overflow of that key (the value below finite, the scaled result
not); ``found_inf["nonfinite_values"]``, bad values (:func:`jaxamp._src.core.marks.step_flags`).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxamp._src.core import policy
from jaxamp._src.scaling.config import AmpConfig, check_flags
from jaxamp._src.core.control import HANDLERS, call, full_flags
from jaxamp._src.core.checks import check_fun
from jaxamp._src.core.marks import (NONFINITE_VALUES, PRIMITIVES, deriv_check_p, deriv_scale_p, merge_found_inf, or_into,
                          reduce_flags, scaler_key, step_flags)
from jaxamp._src.core.tracing import check_amp, state_config, traced
from jaxamp._src.core.interpreter import CALL_PRIMITIVES, bind, cse, eval_jaxpr, holds, sub_jaxprs
from jaxamp._src.core.nesting import NO_DERIVATIVE, Info, analyze
from jaxamp._src.core.window import LOG2_FP16_MAX

__all__ = ["scaled", "evaluate", "inputs", "marks_in", "Context", "Recorder"]

Flags = Dict[str, jax.Array]

def marks_in(jaxpr: jcore.Jaxpr) -> bool:
    """Whether ``jaxpr`` or one of its sub-jaxprs holds a jaxamp mark (cached)."""
    return holds(jaxpr, PRIMITIVES)


def inputs(jaxpr: jcore.Jaxpr) -> List[Info]:
    """The infos of a traced function's arguments: no derivative (:mod:`jaxamp._src.core.nesting`)."""
    return [NO_DERIVATIVE] * len(jaxpr.invars)


class Context:
    """The scales and the key rule of one evaluation."""

    def __init__(self, scales: Mapping[str, Any], amp: Optional[AmpConfig]) -> None:
        self.amp = amp
        self.active = amp is None or amp.scaler_enabled
        self.scales = _opaque(scales) if self.active else {}
        self.evaluate = evaluate  # for the control-flow rules (jaxamp._src.core.control)
        # {key: f32[]} the largest |scaled derivative| checked under each key (the headroom's
        # peak); None inside loop, branch, remat and shard_map bodies (their own traces)
        self.peaks: Optional[Dict[str, jax.Array]] = {}
        # {key: [per-point flags]} of this trace's checks, inlined bodies' too; reduced once by
        # the outermost evaluate
        self.pending: Optional[Dict[str, List[jax.Array]]] = None
        # recording mode (jaxamp.profile): evaluates every equation through the recorder, which
        # sees each checked derivative and each equation's outputs
        self.recorder: Optional[Recorder] = None

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
        marked = analyze(jaxpr, infos).marks
        keys = _ordered(self.key(o, t) for o, t in marked if o > 0)
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


def _ordered(keys) -> List[str]:
    """Keys once each: per-order keys by order, then named keys as they appear."""
    keys = list(dict.fromkeys(keys))
    return sorted((k for k in keys if k.isdigit()), key=int) + [k for k in keys if not k.isdigit()]


def _opaque(scales: Mapping[str, Any]) -> Dict[str, jax.Array]:
    """The scales as float32 through one optimisation barrier: XLA compiles the same graph for
    any scale values, so a program at scale 1 is bit-identical to it with scaling off."""
    if not scales:
        return {}
    keys = list(scales)
    stacked = jax.lax.optimization_barrier(jnp.stack([jnp.asarray(scales[k], jnp.float32) for k in keys]))
    return {k: stacked[i] for i, k in enumerate(keys)}


def _check(ctx: Context, g, v, order: int, term: Optional[str]) -> None:
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
             infos: Sequence[Info], literal: Callable[[Any], Any] = lambda x: x) -> Tuple[List, Flags]:  # fmt: skip
    """The one interpreter of the marks: ``jaxpr`` on ``args`` with every ``deriv_scale_p`` its
    key's scale from ``ctx`` and every ``deriv_check_p``'s flags collected; ``(outs, found_inf)``.
    In recording mode (``ctx.recorder``) the recorder evaluates the other equations and sees
    the checked derivatives (:func:`jaxamp.profile`)."""
    flags: Flags = {}
    owner = ctx.pending is None  # the outermost evaluation of this trace reduces the checks
    pending = ctx.pending = {} if owner else ctx.pending
    analysis = analyze(jaxpr, infos)
    recorder = ctx.recorder

    def rule(eqn, invals):
        outs = marked(eqn, invals)
        if recorder is not None:
            recorder.outputs(eqn, outs)
        return outs

    def marked(eqn, invals):
        prim = eqn.primitive
        if prim is deriv_scale_p:
            return [ctx.scale(eqn.outvars[0].aval.shape, *analysis.resolved[id(eqn)])]
        if prim is deriv_check_p:
            order, term = analysis.resolved[id(eqn)]
            if eqn.params["check"]:
                _check(ctx, *invals, order, term)
                if recorder is not None and order > 0:  # order 0: a value check
                    recorder.derivative(eqn, ctx.key(order, term), invals[0])
            return [invals[0]]
        if not any(marks_in(j) for j in sub_jaxprs(eqn)):  # fast path: nothing of ours inside
            return bind(eqn, invals) if recorder is None else recorder.bind(eqn, invals)
        handler = HANDLERS.get(prim.name, call if prim.name in CALL_PRIMITIVES else None)
        if handler is None:
            raise NotImplementedError(
                f"jaxamp.scaled: jaxamp.grad inside a `{prim.name}` is not supported; supported "
                f"are {sorted(set(HANDLERS) | CALL_PRIMITIVES)}. Move the jaxamp.grad call out of it."
            )
        inlined = handler is call or prim.name.startswith("custom_")  # evaluated in this trace
        outs, sub_flags = handler(eqn, invals, ctx if inlined else ctx.in_body(), analysis.bodies[id(eqn)])
        for k, v in sub_flags.items():
            or_into(flags, k, v)
        return outs

    outs = eval_jaxpr(jaxpr, consts, args, rule, literal=literal)
    if owner:
        ctx.pending = None
        flags = merge_found_inf(flags, reduce_flags(pending))
    return outs, flags


def scaled(fun: Callable[..., Any], amp: Optional[AmpConfig] = None, *, merge: bool = True,
           headroom: bool = False) -> Callable[..., Tuple[Any, ...]]:  # fmt: skip
    """Give the ``jaxamp.grad`` calls in ``fun`` their scales and collect their flags.

    Args:
      fun: any function of arrays whose derivatives are taken with :func:`jaxamp._src.derivatives.grad`
        (directly or through ``vmap``, ``jit``, ``jacrev``, ``scan``, ``cond``, ``while``).
      amp: the scaler mode and special terms. None: per-order keys (``"1"``, ``"2"``, ...),
        or a :class:`jaxamp.Derivatives` engine's own ``amp`` when ``fun`` is the engine.
        A config whose derivative scalers are inactive (bf16, plain fp16): every scale is 1,
        nothing is checked, ``found_inf`` is empty. AMP off (``enabled=False`` or float32):
        ``fun`` runs as written, each ``jaxamp.grad`` as ``jax.grad``.
      merge: in float16, compute once what the program computes twice and depends on no scale
        (:func:`jaxamp._src.core.interpreter.cse`: a user's ``u(params, t, x)`` beside the primal pass of
        ``jaxamp.grad(u)``), before an outer ``jax.grad``, so the backward pass is shared too.
        Values are unchanged; a weight gradient may differ in its last bits. False: as written.
      headroom: also return ``{key: f32[]}``, each key's headroom: ``log2(65504)`` minus log2
        of the largest scaled derivative its checks saw (the values the program holds, at the
        scales given; one max per check, no extra pass). 3 means the largest could grow
        8-fold before it overflowed; ``+inf`` when all were 0, ``-inf`` when one overflowed,
        NaN when one was NaN. Keys whose derivatives all sit inside loop, branch, remat or
        ``shard_map`` bodies are not reported (their checks run in their own traces).

    Returns:
      ``wrapped(state, *args, **kwargs) -> (fun(*args, **kwargs), found_inf)``: ``state`` is
      an :class:`~jaxamp.AmpState` (its config and scales are used; ``amp`` is then ignored),
      an optimizer state holding one (:func:`jaxamp.optimizer`), or ``{key: f32[]}`` scales
      under ``amp``; ``found_inf`` is ``{key: bool[]}`` for every key in the program plus
      ``"nonfinite_values"``; with ``headroom=True``, ``(value, found_inf, headroom)``.

    Outside ``scaled`` (and :func:`jaxamp.value_and_grad`) the derivatives are plain JAX ones at
    scale 1, which may overflow in float16: log a loss through ``scaled(loss)(state, ...)``.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> u_xx = jaxamp.grad(jaxamp.grad(lambda x: jnp.sin(x)))
      >>> value, found_inf = scaled(u_xx)({"1": 0.5, "2": 0.25}, 1.0)
      >>> round(float(value), 4), sorted(found_inf)
      (-0.8415, ['1', '2', 'nonfinite_values'])
      >>> _, _, room = scaled(u_xx, headroom=True)({"1": 0.5, "2": 0.25}, 1.0)
      >>> {k: round(float(v), 3) for k, v in room.items()}  # log2(65504 / |0.5 cos 1|) and of 0.25 sin 1
      {'1': 17.887, '2': 18.248}
    """
    check_fun("jaxamp.scaled", fun, None)
    if amp is None and isinstance(getattr(fun, "amp", None), AmpConfig):
        amp = fun.amp  # a jaxamp.Derivatives engine: its own settings
    check_amp(amp)
    check_flags("jaxamp.scaled", merge=merge, headroom=headroom)

    def result(out, flags: Flags, peaks: Mapping[str, jax.Array]):
        if not headroom:
            return out, flags
        return out, flags, {k: jnp.float32(LOG2_FP16_MAX) - jnp.log2(v) for k, v in peaks.items()}

    def wrapped(scales: Any, *args, **kwargs):
        ctx_amp, scales = state_config(scales, amp, "jaxamp.scaled")
        if ctx_amp is not None and ctx_amp.compute_dtype == jnp.float32:  # AMP off: fun as written
            with policy.using(ctx_amp, "jaxamp.scaled"):  # jaxamp.grad is jax.grad under it
                return result(fun(*args, **kwargs), {}, {})
        ctx = Context(scales, ctx_amp)
        closed, flat, out_tree = traced(fun, args, kwargs, ctx_amp, "jaxamp.scaled")
        if not ctx.active and ctx_amp.loss_scaling_enabled:
            # plain fp16: every order's scale 1 through one barrier, as the scaled program's scales
            marked = analyze(closed.jaxpr, inputs(closed.jaxpr)).marks
            ctx.scales = _opaque({k: 1.0 for k in _ordered(str(o) for o, _ in marked if o > 0)})
        keys = ctx.keys(closed.jaxpr, inputs(closed.jaxpr))
        if not (merge and ctx.scales):  # fp32, bf16, AMP off: the program as JAX would run it
            outs, flags = evaluate(closed.jaxpr, closed.consts, flat, ctx, inputs(closed.jaxpr))
            return result(jax.tree_util.tree_unflatten(out_tree, outs), full_flags(flags, keys), ctx.peaks)
        names, scale_vals = list(ctx.scales), list(ctx.scales.values())

        def program(vals, *leaves):
            ctx.scales, ctx.peaks = dict(zip(names, vals)), {}
            outs, flags = evaluate(closed.jaxpr, closed.consts, leaves, ctx, inputs(closed.jaxpr))
            return outs, full_flags(flags, keys), ctx.peaks

        # The rewritten program without its repeated scale-free work, before an outer
        # jax.grad (the train step's) differentiates it: jaxamp._src.core.interpreter.cse.
        rewritten, shape = jax.make_jaxpr(program, return_shape=True)(scale_vals, *flat)
        rewritten = cse(rewritten, held=range(len(names)))
        results = eval_jaxpr(rewritten.jaxpr, rewritten.consts, [*scale_vals, *flat], bind)
        outs, flags, peaks = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), results)
        return result(jax.tree_util.tree_unflatten(out_tree, outs), flags, peaks)

    return wrapped
