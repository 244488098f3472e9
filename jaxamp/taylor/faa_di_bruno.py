"""Pure derivatives of any order along one direction, one propagated chain per order, each
order carrying its own scale.

``d^K f/dx^K`` by nested ``jax.jvp`` (the forward engine's generic path) differentiates the
whole tangent program again at every order: ``2^K - 1`` tangent chains whose seeds differ
under per-order scaling, so XLA cannot merge them. Taylor mode propagates ``K`` chains:
at every variable ``z`` of ``f`` the derivatives ``z_j = d^j z(x + tau e) / d tau^j`` at
``tau = 0``, ``j = 1..K``. A linear primitive maps each ``z_j`` alone; a nonlinear ``g``
combines them by Faa di Bruno's formula,

    d^k g = sum over partitions p of k:  c(p) * g^(m)[z_{p_1}, ..., z_{p_m}]

(``c(p) = k! / prod_j (mult_j! (j!)^mult_j)``; ``g^(m)`` is the primitive's own ``m``-fold
nested ``jax.jvp``). With DerivScaler, chain ``j`` holds ``Z_j = S_j z_j`` (``S_j`` the
scale of order ``j``): every float16 value of order ``j`` carries that order's scale, and a
term of order ``k`` built from orders ``p`` takes the factor ``S_k / prod S_{p_i}``. Where
the primitive computes in float32 the factor is applied to ``g^(m)``'s result, in float32,
one factor after another (as :func:`jaxamp.taylor._curvature`); in float16 the tangents are
rescaled by powers of two before the product instead, each towards ``S_k ** (p_i / k)``,
so that no partial product overflows where the scaled term would not.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache
from typing import Callable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxamp.taylor import curvature as taylor
from jaxamp.scaler import exact_log2

# Highest derivative order that is not identically zero, for primitives that have one.
_DEGREE = {"mul": 2, "dot_general": 2}


def series(f: Callable[[jax.Array], jax.Array], x: jax.Array, direction: jax.Array, order: int,
                scales: Optional[Sequence[jax.Array]] = None) -> Tuple[jax.Array, List[jax.Array]]:  # fmt: skip
    """``(f(x), [S_1 df[e], S_2 d2f[e, e], ..., S_K dKf[e, ..., e]])`` with ``e = direction``,
    ``K = order`` and ``S = scales`` (float32 scalars; ``None``: all 1). Each entry has
    ``f(x)``'s dtype. ``f`` may close over traced values (parameters).

    Equal, up to rounding, to ``K`` nested ``jax.jvp`` with seeds ``S_1 e`` then
    ``(S_k / S_{k-1}) e``; where ``f`` computes in float16 the values differ by the order of
    float16 roundings, and an order's chain overflows when that order's scaled value does.
    """
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ValueError(f"jaxamp.taylor.series: `order`={order!r} must be an integer >= 1.")
    if scales is not None:
        scales = tuple(jnp.asarray(s, jnp.float32) for s in scales)
        if len(scales) != order:
            raise ValueError(f"jaxamp.taylor.series: got {len(scales)} scales for order {order}; "
                             "pass one per order (S_1, ..., S_K) or None.")
    closed = jax.make_jaxpr(f)(x)
    first = direction.astype(jnp.float32) * (scales[0] if scales is not None else 1.0)
    seed = [first.astype(x.dtype)] + [None] * (order - 1)
    (y,), (s,) = taylor._eval(closed.jaxpr, closed.consts, [x], [seed], None, apply=_applier(scales, order))
    s = s if s is not None else [None] * order
    return y, [jnp.zeros_like(y) if c is None else c for c in s]


@lru_cache(maxsize=None)
def partitions(k: int) -> Tuple[Tuple[Tuple[int, ...], int], ...]:
    """The integer partitions of ``k`` (parts in decreasing order) with Faa di Bruno's
    coefficient ``k! / prod_j (mult_j! (j!)^mult_j)``: ``partitions(3)`` is
    ``(((3,), 1), ((2, 1), 3), ((1, 1, 1), 1))``."""

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


def _multilinear(f, primals, tangents: Sequence[Tuple[jax.Array, ...]]):
    """``f^(m)[t_1, ..., t_m]`` at ``primals``: ``m`` nested ``jax.jvp``."""
    g = f
    for t in tangents[:-1]:
        g = (lambda inner, t: lambda *p: jax.jvp(inner, p, t)[1])(g, t)
    return jax.jvp(g, primals, tangents[-1])[1]


def _applier(scales, order: int):
    """``_apply`` with this series' scales and order, in ``taylor._eval``'s signature."""
    return lambda eqn, vals, ss, _ratio: _apply(eqn, vals, ss, scales, order)


def _apply(eqn, vals: List, ss: List, scales, order: int):
    n_out = len(eqn.outvars)
    idx = [i for i, s in enumerate(ss) if s is not None]
    if not idx:
        return taylor._bind(eqn, vals), [None] * n_out
    name = eqn.primitive.name
    if name in taylor._CALLS and isinstance(eqn.params.get("jaxpr"), jcore.ClosedJaxpr):
        inner = eqn.params["jaxpr"]
        return taylor._eval(inner.jaxpr, inner.consts, vals, ss, None, apply=_applier(scales, order))

    def f(*operands):
        full = list(vals)
        for i, o in zip(idx, operands):
            full[i] = o
        return taylor._bind(eqn, full)

    primals = tuple(vals[i] for i in idx)
    outs = f(*primals)
    if not any(jnp.issubdtype(o.dtype, jnp.inexact) for o in outs):
        return outs, [None] * n_out

    def coeff(j: int):
        """The operands' order-``j`` chains as a jvp tangent, or None where all are zero."""
        cs = [ss[i][j - 1] for i in idx]
        if all(c is None for c in cs):
            return None
        return tuple(jnp.zeros_like(vals[i]) if c is None else c for i, c in zip(idx, cs))

    linear = name in taylor._LINEAR or (name in taylor._BILINEAR and len(idx) == 1)
    degree = 1 if linear else _DEGREE.get(name, order)
    wide = taylor._scales_after(*outs, *(coeff(1) or ()))
    series = []
    for k in range(1, order + 1):
        total = None
        for p, c in partitions(k):
            if len(p) > degree:
                continue
            ts = [coeff(j) for j in p]
            if any(t is None for t in ts):
                continue
            if len(p) == 1:  # the linear term: g'(z) Z_k already carries S_k
                term = jax.jvp(f, primals, ts[0])[1]
            elif wide:  # float32: the product, then its factor S_k / prod S_{p_i} (and c)
                factors = ([scales[k - 1]] + [1.0 / scales[j - 1] for j in p]) if scales is not None else []
                factors = tuple(factors + ([jnp.float32(c)] if c != 1 else []))
                term = _multilinear(f, primals, ts)
                term = [taylor._scaled(t, factors) for t in term] if factors else term
            else:  # float16/bfloat16: rescale the tangents first, so no partial product overflows
                term = _multilinear(f, primals, _rescaled(ts, p, k, scales, c))
            total = term if total is None else [a + b for a, b in zip(total, term)]
        series.append(total)
    out_s = []
    for n, o in enumerate(outs):
        if not jnp.issubdtype(o.dtype, jnp.inexact) or all(s is None for s in series):
            out_s.append(None)
        else:
            out_s.append([None if s is None else s[n] for s in series])
    return outs, out_s


def _rescaled(ts: List[Tuple[jax.Array, ...]], parts: Tuple[int, ...], k: int, scales, c: int):
    """The tangents ``Z_{p_i}`` of one float16 term, each multiplied by a power of two so that
    their product carries ``S_k`` and every partial product stays near the size of the
    result: tangent ``i`` is brought from scale ``S_{p_i}`` to about ``S_k ** (p_i / k)``
    (the factors are 1 when the scales are geometric, ``S_j = s**j``), the last takes what
    remains of ``S_k / prod S_{p_i}``, and the coefficient ``c``."""
    if scales is None:
        factors = [jnp.float32(1.0)] * (len(parts) - 1) + [jnp.float32(c)]
    else:
        log_k = exact_log2(scales[k - 1])
        logs = [exact_log2(scales[j - 1]) for j in parts]
        heads = [jnp.round(j * log_k / k - log_j) for j, log_j in zip(parts[:-1], logs[:-1])]
        exponents = heads + [log_k - sum(logs) - sum(heads)]  # they add up to log2(S_k / prod S_{p_i})
        # beyond +-126/127 a float16 result is 0 or inf anyway
        factors = [jnp.exp2(jnp.clip(a, -126.0, 127.0)) for a in exponents]
        factors[-1] = factors[-1] * jnp.float32(c)
    return [tuple(taylor._scaled(t, (f_,)) for t in ts_i) for ts_i, f_ in zip(ts, factors)]
