"""``scaled``: scales in, overflow flags out, for programs using ``jaxamp.grad``.

``scaled(fun, amp)(scales, *args) -> (fun(*args), found_inf)`` traces ``fun`` to a jaxpr
and evaluates it with the one interpreter of the marks (:func:`jaxamp._src.core.evaluate.evaluate`): every
``deriv_scale_p`` becomes the current scale of its key, every ``deriv_check_p`` ORs its
flags into ``found_inf``. The result is an ordinary JAX function of ``(scales, *args)``: it
composes with ``jax.grad``, ``vmap``, ``jit``, ``jacrev``/``jacfwd`` and ``lax.scan``.

``found_inf[key]`` is a true overflow of that key (the value below finite, the scaled result
not); ``found_inf["nonfinite_values"]``, bad values (:func:`jaxamp._src.core.marks.step_flags`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxamp._src.scaling.config import AmpConfig, check_flags
from jaxamp._src.core.checks import check_fun
from jaxamp._src.core.evaluate import Context, evaluate, full_flags, inputs, opaque, ordered
from jaxamp._src.core.tracing import check_amp, state_config, traced
from jaxamp._src.core.interpreter import bind, cse, eval_jaxpr
from jaxamp._src.core.window import LOG2_FP16_MAX

__all__ = ["scaled"]

Flags = Mapping[str, jax.Array]


def scaled(fun: Callable[..., Any], amp: Optional[AmpConfig] = None, *, merge: bool = True,
           headroom: bool = False) -> Callable[..., Tuple[Any, ...]]:
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
        closed, flat, out_tree = traced(fun, args, kwargs, ctx_amp, "jaxamp.scaled")
        if ctx_amp is not None and ctx_amp.off:  # AMP off: the program as written, JAX's derivatives
            return result(jax.tree_util.tree_unflatten(out_tree, eval_jaxpr(closed.jaxpr, closed.consts, flat, bind)),
                          {}, {})
        ctx = Context(scales, ctx_amp)
        if not ctx.active and ctx_amp.loss_scaling_enabled:
            # plain fp16: every order's scale 1 through one barrier, as the scaled program's scales
            marked = ctx.analyses(closed.jaxpr, inputs(closed.jaxpr)).marks
            ctx.scales = opaque({k: 1.0 for k in ordered(str(o) for o, _ in marked if o > 0)})
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
