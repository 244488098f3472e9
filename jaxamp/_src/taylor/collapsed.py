"""Collapsed Taylor mode (Dangel et al., NeurIPS 2025): ``sum_i d2f[t_i, t_i]`` in one propagation.

``out2 = g'(z) z2 + g''(z)[z1, z1]`` is linear in ``z2``, so only ``z2 = sum_i z2_i`` is propagated,
beside one ``z1_i`` per direction: linear primitives take ``A z2``; elementwise ones
``g'(z) z2 + g''(z) * sum_i z1_i**2``; others a nested ``jax.jvp`` per direction. The directions
are one batch (``jax.vmap`` of each rule over the leading axis of the stacked ``z1``), so the
program and its compile time do not grow with their number. Call and custom-derivative primal
bodies are entered.
Scaling as :func:`jaxamp._src.taylor.second_order`: seeds carry ``S_1``, product terms ``(S_2 / S_1,
1 / S_1)``, in float32 after the product or as two powers of two on float16 tangents before it.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

from jaxamp._src.core import control, interpreter
from jaxamp._src.core.marks import rescale
from jaxamp._src.taylor import rules
from jaxamp._src.taylor.faa_di_bruno import SCALE_AFTER_MIN_BITS, Ratio
from jaxamp._src.taylor.propagate import inexact, multilinear, restrict

__all__ = ["CJet", "ELEMENTWISE", "collapsed_second_order", "propagate_jaxpr"]

# Elementwise in each operand: with one x-dependent operand z of the output's shape,
# sum_i g''(z)[a_i, a_i] = g''(z)[1, sum_i a_i**2] (one nested jvp for all directions).
ELEMENTWISE = frozenset((
    lax.tanh_p, lax.sin_p, lax.cos_p, lax.tan_p, lax.exp_p, lax.exp2_p, lax.log_p, lax.log1p_p, lax.expm1_p,
    lax.logistic_p, lax.integer_pow_p, lax.pow_p, lax.sqrt_p, lax.rsqrt_p, lax.cbrt_p, lax.square_p, lax.erf_p,
    lax.erfc_p, lax.erf_inv_p, lax.sinh_p, lax.cosh_p, lax.asin_p, lax.acos_p, lax.atan_p, lax.asinh_p, lax.acosh_p,
    lax.atanh_p, lax.abs_p, lax.sign_p, lax.mul_p, lax.div_p, lax.max_p, lax.min_p, lax.atan2_p, lax.lgamma_p,
    lax.digamma_p,
))


class CJet(NamedTuple):
    """A value, its first-order coefficients (stacked: ``[D, *value.shape]``, one row per
    direction) and its summed second-order one; None where identically zero."""

    value: Any
    first: Optional[jax.Array] = None
    second: Optional[jax.Array] = None


def _degree(eqn: jcore.JaxprEqn, ones: Sequence[int]) -> Optional[int]:
    if eqn.primitive is jp.div_p and tuple(ones) == (0,):  # a / c is linear in a
        return 1
    return rules.degree(eqn.primitive, len(ones))


def _restrict(eqn: jcore.JaxprEqn, values: Sequence[Any], which: Sequence[int], keep: Sequence[int]) -> Callable:
    """The primitive as a function of operands ``which``, the others held; outputs ``keep``."""
    fn = restrict(eqn, values, which)
    return lambda *operands: [o for k, o in enumerate(fn(*operands)) if k in keep]  # keep is ascending


def _rule(eqn: jcore.JaxprEqn, invals: List[CJet], ratio: Optional[Ratio]) -> List[CJet]:
    values = [v.value for v in invals]
    outs = interpreter.bind(eqn, values)
    keep = [k for k, o in enumerate(outs) if inexact(o.dtype)]
    if not keep:
        return [CJet(o) for o in outs]
    ones = [i for i, v in enumerate(invals) if v.first is not None]
    twos = [i for i, v in enumerate(invals) if v.second is not None]
    if (ones or twos) and _degree(eqn, ones or twos) == 0:  # its outputs do not vary with x
        return [CJet(o) for o in outs]
    first = second = None
    slopes = None  # g'(z) of an elementwise function of one operand: every direction's tangent is g'(z) * t_i
    if ones:
        f1, p1 = _restrict(eqn, values, ones, keep), tuple(values[i] for i in ones)
        if _pointwise(eqn, p1, [outs[k] for k in keep]):
            slopes = jax.jvp(f1, p1, (jnp.ones_like(p1[0]),))[1]
            first = [g[None] * invals[ones[0]].first for g in slopes]
        else:
            first = jax.vmap(lambda *ts: jax.jvp(f1, p1, ts)[1])(*[invals[i].first for i in ones])
    if twos and slopes is not None and twos == ones:
        second = [g * invals[ones[0]].second for g in slopes]
    elif twos:
        f2 = _restrict(eqn, values, twos, keep)
        second = jax.jvp(f2, tuple(values[i] for i in twos), tuple(invals[i].second for i in twos))[1]
    if ones and _degree(eqn, ones) != 1:
        q = _quadratic(eqn, f1, p1, [invals[i].first for i in ones], [outs[k] for k in keep], ratio)
        second = q if second is None else [a + b for a, b in zip(second, q)]
    result = [CJet(o) for o in outs]
    for n, k in enumerate(keep):
        result[k] = CJet(outs[k], None if first is None else first[n], None if second is None else second[n])
    return result


def _pointwise(eqn: jcore.JaxprEqn, p1: Tuple[Any, ...], outs: List[jax.Array]) -> bool:
    """Whether the equation is elementwise in its one x-dependent operand, with that operand's
    shape: its derivative is ``g'(z)`` entry by entry, one array for every direction."""
    return eqn.primitive in ELEMENTWISE and len(p1) == 1 and all(o.shape == p1[0].shape for o in outs)


def _quadratic(eqn, f1: Callable, p1: Tuple[Any, ...], firsts: List[jax.Array], outs: List[jax.Array],
               ratio: Optional[Ratio]) -> List[jax.Array]:
    """``(S_2 / S_1**2) * sum_i g''(z)[z1_i, z1_i]`` of one equation."""
    wide = all(jnp.finfo(v.dtype).bits >= SCALE_AFTER_MIN_BITS for v in (*(f[0] for f in firsts), *outs))
    heads: Tuple[Optional[jax.Array], ...] = (None, None)
    if ratio is not None and not wide:  # float16: bring each tangent to about sqrt(ratio) first
        heads = tuple(ratio.split(2, (1, 1)))

    def pre(t, h):
        return t if h is None else rescale(t, (h,))

    if _pointwise(eqn, p1, outs):
        squares = jnp.sum(pre(firsts[0], heads[0]) * pre(firsts[0], heads[1]), axis=0)
        # g''(z) at unit tangents, times the squares once: the squares enter one product (and
        # their cotangent one product), not every operation of g's rule
        one = jnp.ones_like(p1[0])
        q = [c * squares for c in multilinear(f1, p1, [(one,), (one,)])]
    else:  # a nested jvp per direction, the directions batched
        per = jax.vmap(lambda *ts: multilinear(f1, p1, [tuple(pre(t, h) for t in ts) for h in heads]))(*firsts)
        q = [jnp.sum(p, axis=0) for p in per]
    if ratio is not None and wide:
        q = [rescale(v, ratio.factors) for v in q]
    return q


def _rematerialised(eqn: jcore.JaxprEqn, body: jcore.ClosedJaxpr, args: Sequence[CJet], ratio: Optional[Ratio]
                    ) -> List[CJet]:
    """A ``jax.checkpoint`` body propagated whole (its coefficients the collapsed ones, not a
    nested ``jax.jvp`` per direction), under ``jax.checkpoint`` again with the equation's policy:
    the weight gradient taken through the coefficients recomputes them as the user asked."""
    given = [(v.first is not None, v.second is not None) for v in args]
    made: List[Tuple[bool, bool]] = []  # the outputs' layout, known once the body is traced

    def fn(*flat):
        it = iter(flat)
        ins = [CJet(next(it), next(it) if f else None, next(it) if s else None) for f, s in given]
        outs = _run(body, ins, ratio)
        made[:] = [(o.first is not None, o.second is not None) for o in outs]
        return [a for o in outs for a in o if a is not None]

    it = iter(control.checkpointed(eqn, fn)(*[a for v in args for a in v if a is not None]))
    return [CJet(next(it), next(it) if f else None, next(it) if s else None) for f, s in made]


def _run(closed: jcore.ClosedJaxpr, args: Sequence[CJet], ratio: Optional[Ratio]) -> List[CJet]:
    def step(eqn: jcore.JaxprEqn, invals: List[CJet]) -> List[CJet]:
        if all(v.first is None and v.second is None for v in invals):  # constant in x
            return [CJet(o) for o in interpreter.bind(eqn, [v.value for v in invals])]
        remat = control.remat_body(eqn)
        if remat is not None:
            return _rematerialised(eqn, remat, invals, ratio)
        body = rules.body(eqn)
        body = interpreter.custom_body(eqn) if body is None else body
        return _rule(eqn, invals, ratio) if body is None else _run(body, invals, ratio)

    return interpreter.eval_jaxpr(closed.jaxpr, [CJet(c) for c in closed.consts], args, step, literal=CJet)


def propagate_jaxpr(closed: jcore.ClosedJaxpr, x: jax.Array, tangents: jax.Array,
                    ratio: Optional[Sequence[jax.Array]] = None) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`collapsed_second_order` of ``f`` given as ``closed = jax.make_jaxpr(f)(x)``.

    ``tangents``: ``[D, *x.shape]`` in ``x``'s dtype, carrying ``S_1``; ``ratio``: None or float32
    factors for the product terms (``(S_2 / S_1, 1 / S_1)``). Returns ``(f(x), first, second)``,
    ``first[i] = df[t_i]``, in ``f(x)``'s dtype (zeros where identically 0).
    """
    scaling = None if ratio is None else Ratio(tuple(ratio) if isinstance(ratio, (tuple, list)) else (ratio,))
    d = tangents.shape[0]
    (out,) = _run(closed, [CJet(x, tangents)], scaling)
    first = jnp.zeros((d,) + jnp.shape(out.value), out.value.dtype) if out.first is None else out.first
    second = jnp.zeros_like(out.value) if out.second is None else out.second
    return out.value, first, second


def collapsed_second_order(f: Callable[[jax.Array], jax.Array], x: jax.Array, tangents: jax.Array,
                           ratio: Optional[Sequence[jax.Array]] = None) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """``f(x)``, ``[df[t_i]]_i`` and ``ratio * sum_i d2f[t_i, t_i]`` in one propagation.

    Equal, up to rounding, to summing :func:`jaxamp._src.taylor.second_order` over the rows of
    ``tangents``; the summed second-order coefficient is propagated once instead of ``D`` times.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp._src.taylor.collapsed import collapsed_second_order
      >>> f = lambda x: jnp.sin(x).sum()
      >>> y, d1, lap = collapsed_second_order(f, jnp.array([0.1, 0.2]), jnp.eye(2))
      >>> bool(jnp.allclose(lap, -jnp.sin(0.1) - jnp.sin(0.2)))
      True
    """
    return propagate_jaxpr(jax.make_jaxpr(f)(x), x, tangents, ratio)
