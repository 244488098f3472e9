"""Reading a program's stacked derivatives entry by entry, so the entries it never reads are not planned.

A Jacobian or Hessian taken entry by entry (:mod:`jaxamp._src.derivatives.vector`) is a ``stack``
of chains. :func:`pruned` re-traces a program reading those stacks through: a one-entry ``slice``
reads the stacked operand itself, and a ``select_n`` whose predicate is a constant of the program
(``jnp.trace``, ``jnp.diagonal``, ``jnp.where`` over an ``iota`` mask) takes each stacked entry
from the case its predicate picks. Calls (``jit``) holding a stacked operand are read inline.
Dead equations are then removed: the chains of entries the program never reads (an entry of
``jaxamp.hessian(u, 1)(p, z)[1, 1]``, the off-diagonal entries under a trace) are gone.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as jp
from jax.interpreters import partial_eval as pe

from jaxamp._src.core.interpreter import bind, eval_jaxpr, sub_jaxpr, sub_jaxprs

__all__ = ["pruned"]

# the largest constant (entries) computed while tracing: masks of a Hessian's entries are small
_MAX_CONSTANT = 4096

Part = Tuple[Any, Any]  # (the variable holding a value, or None; the value)


def _iota(*, dtype, shape, dimension, **_):
    line = np.arange(shape[dimension], dtype=dtype).reshape([-1 if i == dimension else 1 for i in range(len(shape))])
    return np.broadcast_to(line, shape)


def _broadcast(x, *, shape, broadcast_dimensions, **_):
    expanded = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        expanded[d] = np.shape(x)[i]
    return np.broadcast_to(np.reshape(x, expanded), shape)


def _binary(fn):
    return lambda x, y, **_: fn(x, y)


# The primitives whose constant results (an iota mask and what a trace or a diagonal builds from
# it) are computed while re-tracing, by numpy: no eager XLA program is compiled for them.
_CONSTANT_RULES = {
    jp.iota_p: _iota,
    jp.broadcast_in_dim_p: _broadcast,
    jp.convert_element_type_p: lambda x, *, new_dtype, **_: np.asarray(x).astype(new_dtype),
    jp.reshape_p: lambda x, *, new_sizes, dimensions, **_: None if dimensions is not None else np.reshape(x, new_sizes),
    jp.squeeze_p: lambda x, *, dimensions, **_: np.squeeze(x, tuple(dimensions)),
    jp.transpose_p: lambda x, *, permutation, **_: np.transpose(x, permutation),
    jp.select_n_p: lambda pred, *cases: np.choose(np.asarray(pred, np.int32), cases),
    jp.not_p: lambda x, **_: np.logical_not(x) if np.asarray(x).dtype == bool else np.invert(x),
    jp.add_p: _binary(np.add), jp.sub_p: _binary(np.subtract), jp.mul_p: _binary(np.multiply),
    jp.eq_p: _binary(np.equal), jp.ne_p: _binary(np.not_equal), jp.lt_p: _binary(np.less),
    jp.le_p: _binary(np.less_equal), jp.gt_p: _binary(np.greater), jp.ge_p: _binary(np.greater_equal),
    jp.and_p: _binary(np.bitwise_and), jp.or_p: _binary(np.bitwise_or),
}


def _fold(eqn, consts: Sequence[np.ndarray]) -> Optional[np.ndarray]:
    """``eqn``'s result from its constant operands by :data:`_CONSTANT_RULES`, in its dtype; None
    where no rule applies (the equation is then traced as it is, its result unknown)."""
    rule = _CONSTANT_RULES.get(eqn.primitive)
    out = eqn.outvars[0].aval
    if rule is None or len(eqn.outvars) != 1 or np.prod(out.shape, dtype=int) > _MAX_CONSTANT:
        return None
    with np.errstate(all="ignore"):  # integer wrap-around as XLA's
        value = rule(*[np.asarray(c) for c in consts], **eqn.params)
    return None if value is None else np.asarray(value, dtype=out.dtype).reshape(out.shape)


def _avals(closed: jcore.ClosedJaxpr) -> List[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in closed.jaxpr.invars]


class _Reader:
    """The rule of one re-trace: which variables are stacks (``{var: (axis, [parts])}``) and
    which are constants of the program (``{var: numpy value}``)."""

    def __init__(self) -> None:
        self.stacks: Dict[Any, Tuple[int, List[Part]]] = {}
        self.known: Dict[Any, np.ndarray] = {}

    def _var(self, v) -> Any:
        return None if isinstance(v, jcore.Literal) else v

    def _constant(self, v) -> Optional[np.ndarray]:
        return np.asarray(v.val) if isinstance(v, jcore.Literal) else self.known.get(v)

    def sliced(self, var, x, start, limit):
        """``x[start:limit]``, read through the stacks ``x`` (of ``var``) was built by."""
        hit = self.stacks.get(var)
        if hit is not None and limit[hit[0]] - start[hit[0]] == 1:
            k, parts = hit
            rest = lambda t: t[:k] + t[k + 1:]  # noqa: E731
            return lax.expand_dims(self.sliced(*parts[start[k]], rest(start), rest(limit)), (k,))
        full = tuple(start) == (0,) * jnp.ndim(x) and tuple(limit) == jnp.shape(x)
        return x if full else lax.slice(x, tuple(start), tuple(limit))

    def transposed(self, var, x, perm: Sequence[int]) -> Part:
        """``transpose(x, perm)`` as a :data:`Part`: when ``x`` (of ``var``) is a stack, a stack
        again (under a key of its own), along the axis its stacking axis moves to, of its parts
        transposed, so that a later read (a ``select_n`` under ``vmap``) still sees the entries."""
        hit = self.stacks.get(var)
        if hit is None:
            return None, lax.transpose(x, tuple(perm))
        k, parts = hit
        rest = [a - (a > k) for a in perm if a != k]  # the parts' own axes, in the new order
        new = [self.transposed(v, part, rest) for v, part in parts]
        key, axis = object(), list(perm).index(k)  # (no variable of the program holds it)
        self.stacks[key] = (axis, new)
        return key, jnp.stack([part for _, part in new], axis=axis)

    def split(self, var, x, shape: Sequence[int]) -> Optional[Part]:
        """``reshape(x, shape)`` that splits the stacking axis ``k`` of ``x`` (of ``var``) into
        ``(a, b)`` (a Jacobian's entries laid out as a matrix), as a stack of ``a`` stacks of ``b``
        parts each (under keys of their own); None for any other reshape."""
        k, parts = self.stacks[var]
        old = tuple(jnp.shape(x))
        if not (len(shape) == len(old) + 1 and tuple(shape[:k]) == old[:k] and tuple(shape[k + 2:]) == old[k + 1:]
                and shape[k] * shape[k + 1] == old[k]):
            return None
        b, rows = shape[k + 1], []
        for j in range(shape[k]):
            key = object()  # (no variable of the program holds it)
            self.stacks[key] = (k, parts[j * b:(j + 1) * b])
            rows.append((key, jnp.stack([part for _, part in parts[j * b:(j + 1) * b]], axis=k)))
        key = object()
        self.stacks[key] = (k, rows)
        return key, jnp.stack([row for _, row in rows], axis=k)

    def relabeled(self, var, x, shape: Sequence[int]) -> Optional[Part]:
        """``reshape(x, shape)`` that only adds or drops unit axes, ``x`` (of ``var``) a stack: a
        stack again, along the axis its stacking axis becomes, of its parts relabelled alike
        (a scalar entry as ``(1,)`` beside a vector's entries); None for any other reshape."""
        k, parts = self.stacks[var]
        old, shape = tuple(jnp.shape(x)), tuple(shape)
        if old[k] == 1 or [d for d in old if d != 1] != [d for d in shape if d != 1]:
            return None
        axis = [i for i, d in enumerate(shape) if d != 1][[i for i, d in enumerate(old) if d != 1].index(k)]
        rest = shape[:axis] + shape[axis + 1:]
        new = []
        for v, part in parts:
            hit = self.relabeled(v, part, rest) if v is not None and v in self.stacks else None
            new.append(hit if hit is not None else (None, jnp.reshape(part, rest)))
        key = object()  # (no variable of the program holds it)
        self.stacks[key] = (axis, new)
        return key, jnp.stack([part for _, part in new], axis=axis)

    def concatenated(self, operands: Sequence[Part], axis: int) -> Part:
        """``concatenate`` of ``operands`` along ``axis`` as a :data:`Part`, a stack when the
        operands are stacks along ``axis`` or one entry thick there (a scalar's derivative beside
        a vector's), or all stacks along one other axis with as many parts (rows of a Hessian's
        blocks joined: each row the join of the blocks' rows)."""
        value = lax.concatenate([x for _, x in operands], axis)
        found = [self.stacks.get(v) if v is not None else None for v, _ in operands]
        parts: List[Part] = []
        for (v, x), hit in zip(operands, found):
            if hit is not None and hit[0] == axis:
                parts += hit[1]
            elif jnp.shape(x)[axis] == 1:  # a stack along another axis stays one (its entries read through)
                thin = tuple(d for i, d in enumerate(jnp.shape(x)) if i != axis)
                parts.append((hit is not None and self.relabeled(v, x, thin)) or (None, lax.squeeze(x, (axis,))))
            else:
                parts = []
                break
        key = object()  # (no variable of the program holds it)
        if parts:
            self.stacks[key] = (axis, parts)
            return key, value
        ks = {hit[0] for hit in found if hit is not None}
        if all(hit is not None for hit in found) and len(ks) == 1 and axis not in ks:
            k = ks.pop()
            if len({len(hit[1]) for hit in found}) == 1:
                inner = axis - (axis > k)
                rows = [self.concatenated([hit[1][j] for hit in found], inner) for j in range(len(found[0][1]))]
                self.stacks[key] = (k, rows)
                return key, value
        return None, value

    def select(self, pred: np.ndarray, cases: Sequence[Part]) -> Any:
        """``select_n(pred, *cases)`` with the constant ``pred``: each stacked entry from the case
        its predicate picks, so the entries of the other cases are not read."""
        flat = pred.reshape(-1)
        if flat.size and np.all(flat == flat[0]):
            return cases[int(flat[0])][1]
        hit = next(((c, self.stacks[v]) for c, (v, _) in enumerate(cases) if v is not None and v in self.stacks), None)
        if hit is None or pred.ndim == 0:
            return lax.select_n(jnp.asarray(pred), *[x for _, x in cases])
        c, (k, parts) = hit
        rows = []
        for j in range(pred.shape[k]):
            sub = [parts[j] if i == c else (None, lax.index_in_dim(x, j, k, keepdims=False))
                   for i, (_, x) in enumerate(cases)]
            rows.append(self.select(np.take(pred, j, axis=k), sub))
        return jnp.stack(rows, axis=k)

    def rule(self, eqn, vals) -> List[Any]:
        p = eqn.params
        ins = [self._var(v) for v in eqn.invars]
        for v in eqn.outvars:
            self.stacks.pop(v, None)
            self.known.pop(v, None)
        consts = [self._constant(v) for v in eqn.invars]
        if eqn.primitive is jp.slice_p and not p.get("strides") and ins[0] in self.stacks:
            return [self.sliced(ins[0], vals[0], p["start_indices"], p["limit_indices"])]
        if eqn.primitive is jp.transpose_p and ins[0] in self.stacks:
            key, out = self.transposed(ins[0], vals[0], p["permutation"])
            self.stacks[eqn.outvars[0]] = self.stacks[key]
            return [out]
        if eqn.primitive is jp.reshape_p and ins[0] in self.stacks and p.get("dimensions") is None:
            hit = self.split(ins[0], vals[0], p["new_sizes"]) or self.relabeled(ins[0], vals[0], p["new_sizes"])
            if hit is not None:
                self.stacks[eqn.outvars[0]] = self.stacks[hit[0]]
                return [hit[1]]
        if eqn.primitive is jp.squeeze_p and ins[0] in self.stacks:
            hit = self.relabeled(ins[0], vals[0], eqn.outvars[0].aval.shape)
            if hit is not None:
                self.stacks[eqn.outvars[0]] = self.stacks[hit[0]]
                return [hit[1]]
        if eqn.primitive is jp.concatenate_p and any(v is not None and v in self.stacks for v in ins):
            key, _ = self.concatenated(list(zip(ins, vals)), p["dimension"])
            outs = bind(eqn, vals)
            if key is not None:
                self.stacks[eqn.outvars[0]] = self.stacks[key]
            return outs
        if (eqn.primitive is jp.select_n_p and consts[0] is not None
                and any(v is not None and v in self.stacks for v in ins[1:])):
            return [self.select(consts[0], list(zip(ins[1:], vals[1:])))]
        body = sub_jaxpr(eqn)
        if body is not None and any(v is not None and (v in self.stacks or v in self.known) for v in ins):
            for inner, v in zip(body.jaxpr.invars, ins):  # read the call inline, its operands' stacks through
                self.stacks.pop(inner, None)
                self.known.pop(inner, None)
                if v in self.stacks:
                    self.stacks[inner] = self.stacks[v]
                if v in self.known:
                    self.known[inner] = self.known[v]
            return eval_jaxpr(body.jaxpr, body.consts, vals, self.rule)
        folded = _fold(eqn, consts) if all(c is not None for c in consts) else None
        if folded is not None:  # a constant of the program (an iota mask): known while tracing
            self.known[eqn.outvars[0]] = folded
            return [jnp.asarray(folded)]
        outs = bind(eqn, vals)
        if eqn.primitive is jax.lax.stack_p:
            self.stacks[eqn.outvars[0]] = (p["axis"], list(zip(ins, vals)))
        return outs


def pruned(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` with its stacks read entry by entry (module docstring), then its dead
    equations removed."""
    traced = closed
    if any(e.primitive is jax.lax.stack_p for e in closed.jaxpr.eqns):
        reader = _Reader()
        traced = jax.make_jaxpr(lambda *a: eval_jaxpr(closed.jaxpr, closed.consts, a, reader.rule))(*_avals(closed))
    live, _ = pe.dce_jaxpr(traced.jaxpr, [True] * len(traced.jaxpr.outvars), instantiate=True)
    return jcore.ClosedJaxpr(live, traced.consts)
