"""The float16 network as a primitive: every derivative of it is scaled, whoever takes it.

:func:`jaxamp.autocast` (with derivative scalers on) evaluates its placed program as one
``boundary_p`` equation. Its rules put the DerivScaler where JAX's own transformations cross the
network, so ``jax.grad``, ``jax.jacfwd``, ``jax.jacrev``, ``jax.hessian``, ``jax.jvp``,
``jax.linearize`` and any library operator built on them are scaled and checked as
``jaxamp.grad`` is:

* **JVP.** A tangent entering along an input (not a parameter) is an input derivative one order
  above the equation's ``level``: it is multiplied by ``c = s_k / s_(k-1)`` (``s_k``: the scale of
  key ``"k"``, a :data:`~jaxamp._src.core.marks.deriv_scale_p` mark; ``s_0 = 1``), so every
  order-``k`` value inside the float16 region carries ``s_k`` whatever its lower orders carry;
  the tangent leaving is checked under key ``"k"`` and multiplied by ``1/c`` in float32. The
  tangent program is a new ``boundary_p`` of level ``k`` (its own derivatives go one order up).
  Tangents along parameters only (weight gradients: the loss scaler's) pass unscaled.
* **Transpose.** A scaled tangent equation is linear in its tangents; its transpose scales the
  *cotangent* by ``c`` on the way in and by ``1/c`` on the way out (a plain transpose would do
  the opposite and push float16 out of range), checked under the same key.
* **Batching** batches the body; **partial evaluation** needs no rule: the primal and the tangent
  are separate equations (the tangent program recomputes what it needs of the primal from the
  equation's operands, which XLA shares with the primal pass).

The order is read from the program (how many input-derivative levels an equation carries),
never from the call site. The marks it writes are interpreted by :func:`jaxamp.scaled` (and so
:func:`jaxamp.value_and_grad`, :func:`jaxamp.init`, :func:`jaxamp.profile`); a derivative of the
network compiled outside them raises, naming the fix, instead of running unscaled.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from jaxamp._src.core import control
from jaxamp._src.core.interpreter import bind, eval_jaxpr, holds
from jaxamp._src.core.marks import deriv_check, deriv_scale_p, fresh, rescale, seed
from jaxamp._src.core.rules import RULES, PrimitiveRules

__all__ = ["boundary_p", "network", "crosses", "NAME"]

NAME = "jaxamp_boundary"
boundary_p = jcore.Primitive(NAME)
boundary_p.multiple_results = True
# A placeholder operand for the scale marks the rules write: a literal, so the marks' order is
# absolute (jaxamp._src.core.nesting reads a mark's order relative to its operand's).
_ANCHOR = 0.0


def network(closed: jcore.ClosedJaxpr, operands: Sequence[Any], is_param: Sequence[bool]) -> List[Any]:
    """``closed`` (the placed network, flat) on ``operands`` as one ``boundary_p`` equation of
    level 0; ``is_param[i]``: operand ``i`` is a parameter (its tangents are weight derivatives)."""
    return boundary_p.bind(*operands, jaxpr=closed, level=0, is_param=tuple(is_param), scaled=False)


def crosses(fun, args: Sequence[Any], kwargs=None) -> bool:
    """Whether ``fun(*args, **kwargs)`` evaluates a network boundary: its derivatives are then
    scaled by the boundary's rules, and a jaxamp derivative taken with JAX's own transformations
    must not scale them again."""
    kwargs = kwargs or {}
    try:
        closed = jax.make_jaxpr(lambda *a: fun(*a, **kwargs))(*args)
    except TypeError:  # non-array arguments: traced as the caller traces them
        return False
    return holds(closed.jaxpr, frozenset((boundary_p,)))


def _eval(*args, jaxpr, **_):
    return eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, args, bind)


def _abstract(*avals, jaxpr, **_):
    return list(jaxpr.out_avals)


def _float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _scale(order: int) -> jax.Array:
    """``s_order`` (f32[], unbatched): the scale of key ``str(order)`` once interpreted."""
    return deriv_scale_p.bind(jnp.float32(_ANCHOR), order=order, term=None, wrt=None, scalar=True, required=True)


def _ratio(order: int) -> jax.Array:
    """``s_order / s_(order-1)`` (``s_0 = 1``): exact, the scales are powers of two."""
    s = _scale(order)
    return s if order == 1 else s / _scale(order - 1)


def _call(jaxpr: jcore.ClosedJaxpr):
    """``jaxpr`` as a function of its operands (a list of outputs)."""
    return lambda *args: eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, args, bind)


def _tangent_program(jaxpr: jcore.ClosedJaxpr, nonzeros: Sequence[bool]) -> jcore.ClosedJaxpr:
    """``(c, *primals, *nonzero tangents) -> output tangents`` of ``jaxpr`` (``c``, the scale,
    is an operand the program does not read), differentiated along the nonzero tangents only."""
    f = _call(jaxpr)

    def tangents(c, *args):
        primals, ts = args[: len(nonzeros)], args[len(nonzeros):]

        def along(*moving):
            it = iter(moving)
            return f(*(next(it) if nz else p for p, nz in zip(primals, nonzeros)))

        return jax.jvp(along, [p for p, nz in zip(primals, nonzeros) if nz], list(ts))[1]

    avals = [jax.typeof(jnp.float32(1.0)), *jaxpr.in_avals,
             *(a.to_tangent_aval() for a, nz in zip(jaxpr.in_avals, nonzeros) if nz)]
    return jax.make_jaxpr(tangents)(*avals)


def _jvp(primals, tangents, *, jaxpr, level, is_param, scaled):
    nonzeros = [type(t) is not ad.Zero for t in tangents]
    if not any(nz and not p for nz, p in zip(nonzeros, is_param)):
        # along parameters only (weight gradients, the loss scaler's): JAX's own derivative of the
        # body, the program plain float16 compiles (bit for bit at scale 1)
        f = _call(jaxpr)

        def along(*moving):
            it = iter(moving)
            return f(*(next(it) if nz else p for p, nz in zip(primals, nonzeros)))

        moving = [p for p, nz in zip(primals, nonzeros) if nz]
        return jax.jvp(along, moving, [t for t in tangents if type(t) is not ad.Zero])
    outs = boundary_p.bind(*primals, jaxpr=jaxpr, level=level, is_param=is_param, scaled=scaled)
    program = _tangent_program(jaxpr, nonzeros)
    order, c = level + 1, _ratio(level + 1)
    ts = [seed(t, c, t.dtype) if _float(t) else t for t, nz in zip(tangents, nonzeros) if nz]
    kinds = (True, *is_param, *(p for p, nz in zip(is_param, nonzeros) if nz))
    gs = boundary_p.bind(c, *primals, *ts, jaxpr=program, level=order, is_param=kinds, scaled=True)
    # checked where float16 holds them scaled, unscaled in float32
    return outs, [rescale(deriv_check(g, fresh(y), order=order, term=None), (1.0 / c,)) if _float(g) else g
                  for g, y in zip(gs, outs)]


def _transpose(cts, *operands, jaxpr, level, is_param, scaled):
    linear = [ad.is_undefined_primal(x) for x in operands]
    known = [x for x, lin in zip(operands, linear) if not lin]
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    c = operands[0] if scaled else None
    if scaled:  # the cotangent enters the float16 region scaled by c: ct * c, as the tangent did
        cts = [rescale(ct, (c, c)) if _float(ct) else ct for ct in cts]  # undoes the unscale's 1/c first
    program = _transposed_program(jaxpr, linear, [jax.typeof(k) for k in known], [jax.typeof(ct) for ct in cts])
    kinds = (*(p for p, lin in zip(is_param, linear) if not lin), *(False,) * len(cts))
    outs = boundary_p.bind(*known, *cts, jaxpr=program, level=level, is_param=kinds, scaled=False)
    if scaled:  # checked where float16 holds it scaled; out by 1/c for the unscale and 1/c for the seed's transpose
        below = fresh(_finite_or_nan([x for x, lin, p in zip(operands, linear, is_param) if not (lin or p)]))
        outs = [rescale(deriv_check(g, below, order=level, term=None), (1.0 / c, 1.0 / c)) if _float(g) else g
                for g in outs]
    it = iter(outs)
    return [next(it) if lin else None for lin in linear]


def _finite_or_nan(values) -> jax.Array:
    """``f32[]``: 0 where every float value (the network's inputs at this point) is finite, else NaN:
    the value below a transposed derivative for its check, so that a bad input is a bad value
    (``NONFINITE_VALUES``), not an overflow of the derivative's key."""
    ok = jnp.bool_(True)
    for x in values:
        if _float(x):
            ok = ok & jnp.all(jnp.isfinite(x))
    return jnp.where(ok, jnp.float32(0.0), jnp.float32(jnp.nan))


def _transposed_program(jaxpr, linear, known_avals, ct_avals) -> jcore.ClosedJaxpr:
    """``(*known operands, *cotangents) -> cotangents of the linear operands`` of ``jaxpr``."""
    lin_avals = [a for a, lin in zip(jaxpr.in_avals, linear) if lin]

    def transposed(*args):
        known, cts = args[: len(known_avals)], args[len(known_avals):]

        def forward(*lins):
            it_k, it_l = iter(known), iter(lins)
            full = [next(it_l) if lin else next(it_k) for lin in linear]
            return eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, full, bind)

        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in lin_avals]
        return jax.linear_transpose(forward, *specs)(list(cts))

    return jax.make_jaxpr(transposed)(*known_avals, *ct_avals)


def _batch(args, dims, *, jaxpr, level, is_param, scaled):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    body = jax.make_jaxpr(jax.vmap(_call(jaxpr), in_axes=list(dims), axis_size=size))(*map(jax.typeof, args))
    outs = boundary_p.bind(*args, jaxpr=body, level=level, is_param=is_param, scaled=scaled)
    return outs, [0] * len(outs)


boundary_p.def_impl(_eval)
boundary_p.def_abstract_eval(_abstract)
ad.primitive_jvps[boundary_p] = _jvp
ad.primitive_transposes[boundary_p] = _transpose
batching.primitive_batchers[boundary_p] = _batch
mlir.register_lowering(boundary_p, mlir.lower_fun(_eval, multiple_results=True))
# a call whose body jaxamp's interpreters inline; jaxamp.scaled inlines it even without a mark
# inside (its derivatives were taken, and their marks written, when the program was traced)
RULES[boundary_p] = PrimitiveRules(call="jaxpr", evaluate=control.call, in_trace=True, inline=True)
