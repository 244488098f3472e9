"""The Taylor rule: Faa di Bruno's formula with one scale per order (docs/algorithm.md).

``d^k g = sum over partitions p of k: c(p) * g^(m)[z_{p_1}, ..., z_{p_m}]`` (``g^(m)``: ``m`` nested
``jax.jvp``; degree ``d`` primitives keep ``m <= d``). Order ``j`` is stored as ``Z_j = S_j z_j``,
so a term takes the factor ``S_k / prod S_{p_i}``: in float32 or wider after the product, one
factor after another; in float16/bfloat16 as powers of two on the tangents first (each to about
``S_k ** (p_i / k)``), so no partial product overflows.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from jaxamp._src.scaling.scaler import exact_log2
from jaxamp._src.core.marks import rescale
from jaxamp._src.taylor.propagate import Application, Coefficients, Rule, inexact, multilinear

__all__ = ["SCALE_AFTER_MIN_BITS", "Scales", "Ratio", "series_rule", "partitions"]

# Primitives whose outputs and tangents are at least this wide (float32, float64) scale a
# product term after the product; narrower ones rescale its tangents before it.
SCALE_AFTER_MIN_BITS = 32


class Scales:
    """Per-order scales ``S_1..S_K`` (float32 scalars) of the propagated coefficients."""

    def __init__(self, scales: Sequence[jax.Array]):
        self.scales = tuple(jnp.asarray(s, jnp.float32) for s in scales)

    def product(self, k: int, parts: Tuple[int, ...]) -> Tuple[jax.Array, ...]:
        """Factors ``(S_k / S_{p_1}, 1 / S_{p_2}, ...)`` whose product is ``S_k / prod S_{p_i}``."""
        first = self.scales[k - 1] / self.scales[parts[0] - 1]
        return (first,) + tuple(1.0 / self.scales[j - 1] for j in parts[1:])

    def split(self, k: int, parts: Tuple[int, ...]) -> List[jax.Array]:
        """One power of two per tangent, their product ``S_k / prod S_{p_i}``: tangent ``i``
        goes from ``S_{p_i}`` to about ``S_k ** (p_i / k)``, the last takes the rest."""
        log_k = exact_log2(self.scales[k - 1])
        logs = [exact_log2(self.scales[j - 1]) for j in parts]
        heads = [jnp.round(j * log_k / k - log_j) for j, log_j in zip(parts[:-1], logs[:-1])]
        return _powers(heads + [log_k - sum(logs) - sum(heads)])


class Ratio:
    """A second order's scaling as the ratio ``S_2 / S_1**2`` alone, in factors applied one
    after another (``(S_2 / S_1, 1 / S_1)``: their product may leave float32's range)."""

    def __init__(self, factors: Sequence[jax.Array]):
        self.factors = tuple(jnp.asarray(r, jnp.float32) for r in factors)

    def product(self, k: int, parts: Tuple[int, ...]) -> Tuple[jax.Array, ...]:
        """The factors (the only product term of order 2 is ``parts == (1, 1)``)."""
        return self.factors

    def split(self, k: int, parts: Tuple[int, ...]) -> List[jax.Array]:
        """:meth:`Scales.split` for ``(1, 1)``, which depends on the ratio alone."""
        total = sum(exact_log2(r) for r in self.factors)
        head = jnp.round(total / 2)
        return _powers([head, total - head])


def _powers(exponents: List[jax.Array]) -> List[jax.Array]:
    """``2 ** e`` in float32; beyond +-126/127 a float16 result is 0 or inf anyway."""
    return [jnp.exp2(jnp.clip(e, -126.0, 127.0)) for e in exponents]


def series_rule(scaling: Union[None, Scales, Ratio], order: int) -> Rule:
    """The :func:`~jaxamp._src.taylor.propagate.propagate` rule for orders ``1..order``, with the
    coefficients' ``scaling`` (:class:`Scales`, :class:`Ratio`, or None: all 1)."""

    def rule(app: Application) -> Tuple[List[jax.Array], List[Optional[Coefficients]]]:
        every = range(len(app.dependent))
        primals, fn = app.primals(every), app.restrict(every)

        def coeff(j: int) -> Optional[Tuple[jax.Array, ...]]:
            """The order-``j`` coefficients as a jvp tangent (None where all are zero)."""
            cs = [c[j - 1] for c in app.coefficients]
            if all(c is None for c in cs):
                return None
            return tuple(jnp.zeros_like(p) if c is None else c for p, c in zip(primals, cs))

        outs, first = jax.jvp(fn, primals, coeff(1))
        if not any(inexact(o.dtype) for o in outs):
            return outs, [None] * len(outs)
        wide = all(inexact(v.dtype) and jnp.finfo(v.dtype).bits >= SCALE_AFTER_MIN_BITS
                   for v in (*coeff(1), *outs))
        terms = [first]
        for k in range(2, order + 1):
            total = None
            for parts, c in partitions(k):
                if app.degree is not None and len(parts) > app.degree:
                    continue
                if len(parts) == 1:  # the linear term, g'(z) Z_k, over the operands that have Z_k
                    which = [w for w in every if app.coefficients[w][k - 1] is not None]
                    if not which:
                        continue
                    tangent = tuple(app.coefficients[w][k - 1] for w in which)
                    term = jax.jvp(app.restrict(which), app.primals(which), tangent)[1]
                else:
                    tangents = [coeff(j) for j in parts]
                    if any(t is None for t in tangents):
                        continue
                    term = _product(fn, primals, tangents, scaling, k, parts, c, wide)
                total = term if total is None else [a + b for a, b in zip(total, term)]
            terms.append(total)
        return outs, [tuple(None if t is None else t[n] for t in terms) for n in range(len(outs))]

    return rule


def _product(fn: Callable[..., List[jax.Array]], primals: Tuple[jax.Array, ...],
             tangents: List[Tuple[jax.Array, ...]], scaling: Union[None, Scales, Ratio], k: int,
             parts: Tuple[int, ...], c: int, wide: bool) -> List[jax.Array]:
    """``c * (S_k / prod S_{p_i}) * g^(m)[Z_{p_1}, ..., Z_{p_m}]`` of one primitive."""
    if wide:  # the product, then its factors in float32
        factors = (scaling.product(k, parts) if scaling is not None else ()) + ((jnp.float32(c),) if c != 1 else ())
        term = multilinear(fn, primals, tangents)
        return [rescale(t, factors) for t in term] if factors else term
    # float16/bfloat16: rescale the tangents first, so that no partial product overflows
    factors = scaling.split(k, parts) if scaling is not None else [None] * len(parts)
    if c != 1:
        factors[-1] = jnp.float32(c) if factors[-1] is None else factors[-1] * jnp.float32(c)
    tangents = [ts if f is None else tuple(rescale(t, (f,)) for t in ts) for ts, f in zip(tangents, factors)]
    return multilinear(fn, primals, tangents)


def partitions(k: int) -> Tuple[Tuple[Tuple[int, ...], int], ...]:
    """The integer partitions of ``k >= 1`` (parts decreasing, ``(k,)`` first), each with
    Faa di Bruno's coefficient ``c = k! / prod_j (mult_j! (j!)^mult_j)``.

    Example:
      >>> from jaxamp._src.taylor.faa_di_bruno import partitions
      >>> partitions(3)
      (((3,), 1), ((2, 1), 3), ((1, 1, 1), 1))
    """

    def parts(n: int, largest: int):
        if n == 0:
            yield ()
            return
        for first in range(min(n, largest), 0, -1):
            for rest in parts(n - first, first):
                yield (first,) + rest

    out = []
    for p in parts(k, k):
        denom = 1
        for j, mult in Counter(p).items():
            denom *= math.factorial(mult) * math.factorial(j) ** mult
        out.append((p, math.factorial(k) // denom))
    return tuple(out)
