"""Second-order forward mode along one direction, with the two tangents' scales kept apart.

A pure second derivative ``d2f/dx2`` by nested ``jax.jvp`` seeds the inner tangent with ``a``
and the outer one with ``b``: every layer then carries three tangent chains, the inner tangent
``a * dz``, the outer tangent of the primal ``b * dz`` and the second-order ``a*b * d2z``.
Unscaled (``a == b``) the first two are the same computation and XLA merges them; under
DerivScaler per-order scaling ``a = s_1``, ``b = s_2 / s_1`` and they are not, so the network's
tangent is propagated twice (the cavity step: 9 % more FLOPs than unscaled).

Both chains are the same linear map of the seed, and ``b / a = s_2 / s_1**2`` is a power of
two, so the outer tangent at every variable is *exactly* ``(b / a)`` times the inner one
(binary scaling commutes with rounding for normal numbers; an overflow is an ``inf`` in
both). :func:`second_order` interprets ``f``'s jaxpr and, at every primitive, forms the outer
tangent from the inner one by that factor instead of propagating it; the primitive's own
nested ``jax.jvp`` then gives the second-order term, so each float16 value is the one nested
``jax.jvp`` computes, up to rounding at the subnormal/overflow edge. Primitives that compute
in float32 (jaxamp's float32 activations) take that nested jvp with one tangent and scale
its result instead, which spares the weight gradient a stored scaled tangent per layer.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

Series = Optional[Tuple[jax.Array, Optional[jax.Array]]]  # (inner tangent, second order or None)

# Primitives linear in their x-dependent operands (others held fixed): each tangent goes
# through the primitive's own jvp, with no second-order term.
_LINEAR = frozenset(
    "add add_any sub neg convert_element_type reshape broadcast_in_dim squeeze expand_dims transpose "
    "slice concatenate reduce_sum copy real imag conj pad rev select_n dynamic_slice "
    "dynamic_update_slice gather".split()
)
_BILINEAR = frozenset(("mul", "dot_general"))  # linear in each operand: linear when only one depends on x
_CALLS = frozenset(("pjit", "jit", "closed_call", "core_call"))
# Nonlinear primitives this wide (float32, float64) scale their second-order term after the
# primitive's nested jvp, narrower ones scale the outer tangent before it (see _curvature).
_SCALE_AFTER_MIN_BITS = 32


def second_order(f: Callable[[jax.Array], jax.Array], x: jax.Array, tangent: jax.Array,
                 ratio: Union[None, jax.Array, Sequence[jax.Array]]):
    """``(f(x), df[t], d2f[t, ratio * t])`` with ``t = tangent``; ``ratio`` a float32 scalar or
    a sequence of factors applied one after another (``(s2 / s1, 1 / s1)``: their product
    ``s2 / s1**2`` may leave float32's range where each factor and each partial result does
    not), or ``None`` for ``d2f[t, t]`` (both tangents the same).

    Equal to ``jax.jvp(lambda z: jax.jvp(f, (z,), (t,))[1], (x,), (ratio * t,))`` but with one
    propagated tangent chain instead of two. ``f`` may close over traced values (parameters).
    """
    closed = jax.make_jaxpr(f)(x)
    if ratio is not None:
        ratio = tuple(jnp.asarray(r, jnp.float32) for r in (ratio if isinstance(ratio, (tuple, list)) else (ratio,)))
    (y,), (s,) = _eval(closed.jaxpr, closed.consts, [x], [(tangent, None)], ratio)
    if s is None:  # f does not depend on x
        zero = jnp.zeros_like(y)
        return y, zero, zero
    t1, t2 = s
    return y, t1, (jnp.zeros_like(y) if t2 is None else t2)


def _scaled(t: jax.Array, ratio: Tuple[jax.Array, ...]) -> jax.Array:
    """``ratio * t`` in float32, factor by factor, rounded once to ``t``'s dtype (an overflow
    becomes inf, as it does in nested jvp's outer tangent)."""
    out = t.astype(jnp.float32)
    for r in ratio:
        out = out * r
    return out.astype(t.dtype)


def _is_float(v) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.inexact)


def _eval(jaxpr, consts, args, series: Sequence[Series], ratio, apply=None):
    """Evaluate ``jaxpr`` on ``args`` and their series; ``apply(eqn, vals, series, ratio)``
    (default :func:`_apply`) maps one equation's operands and series to its outputs'."""
    apply = _apply if apply is None else apply
    env, env_s = {}, {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def read_s(v):
        return None if isinstance(v, jcore.Literal) else env_s.get(v)

    for v, val in zip(jaxpr.constvars, consts):
        env[v] = val
    for v, val, s in zip(jaxpr.invars, args, series):
        env[v] = val
        if s is not None:
            env_s[v] = s
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        ss = [read_s(v) for v in eqn.invars]
        outs, out_s = apply(eqn, vals, ss, ratio)
        for v, o, s in zip(eqn.outvars, outs, out_s):
            if isinstance(v, jcore.DropVar):
                continue
            env[v] = o
            if s is not None and _is_float(v):
                env_s[v] = s
    return [read(v) for v in jaxpr.outvars], [read_s(v) for v in jaxpr.outvars]


def _bind(eqn, vals):
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _apply(eqn, vals: List, ss: List[Series], ratio):
    n_out = len(eqn.outvars)
    idx = [i for i, s in enumerate(ss) if s is not None]
    if not idx:
        return _bind(eqn, vals), [None] * n_out
    name = eqn.primitive.name
    if name in _CALLS and isinstance(eqn.params.get("jaxpr"), jcore.ClosedJaxpr):
        inner = eqn.params["jaxpr"]
        return _eval(inner.jaxpr, inner.consts, vals, ss, ratio)

    def at(which: Sequence[int]):
        """The primitive as a function of the operands ``which`` (the others held fixed)."""

        def fn(*operands):
            full = list(vals)
            for i, o in zip(which, operands):
                full[i] = o
            return _bind(eqn, full)

        return fn

    f = at(idx)
    primals = tuple(vals[i] for i in idx)
    t1 = tuple(ss[i][0] for i in idx)
    outs, y1 = jax.jvp(f, primals, t1)
    with_t2 = [i for i in idx if ss[i][1] is not None]
    y2 = jax.jvp(at(with_t2), tuple(vals[i] for i in with_t2), tuple(ss[i][1] for i in with_t2))[1] if with_t2 else None
    linear = name in _LINEAR or (name in _BILINEAR and len(idx) == 1)
    if not linear:
        curv = _curvature(f, primals, t1, outs, ratio)
        y2 = curv if y2 is None else [a + b for a, b in zip(curv, y2)]
    if y2 is None:
        return outs, [(a, None) for a in y1]
    return outs, list(zip(y1, y2))


def _curvature(f, primals, t1, outs, ratio) -> List[jax.Array]:
    """``d2f[t, ratio * t]`` of one nonlinear primitive, from its own nested jvp.

    The term is bilinear in its two tangents, so it equals ``ratio * d2f[t, t]``. Where the
    primitive computes in float32 or wider (jaxamp's float32 activations) the scaling is done
    after: ``d2f[t, t]`` has one tangent, so XLA shares it with the first-order term, and the
    scaled tangent is never stored for the backward pass. Binary scaling is exact in float32
    unless a partial result leaves float32's range (far outside float16's, where the result
    ends up). In float16/bfloat16 the product ``d2f[t, t]`` could overflow where the scaled
    one does not, so the outer tangent is scaled first, as nested ``jax.jvp`` does.
    """
    def nested(outer):
        return jax.jvp(lambda *p: jax.jvp(f, p, t1)[1], primals, outer)[1]

    if ratio is None:
        return nested(t1)
    if _scales_after(*t1, *outs):
        return [_scaled(c, ratio) for c in nested(t1)]
    return nested(tuple(_scaled(t, ratio) for t in t1))


def _scales_after(*arrays: jax.Array) -> bool:
    """Whether a primitive with these tangents and outputs computes wide enough (float32 or
    more, see ``_SCALE_AFTER_MIN_BITS``) to scale its higher-order terms after the product."""
    return all(jnp.issubdtype(v.dtype, jnp.inexact) and jnp.finfo(v.dtype).bits >= _SCALE_AFTER_MIN_BITS
               for v in arrays)
