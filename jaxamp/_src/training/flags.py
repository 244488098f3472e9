"""The flag algebra of a train step (docs/algorithm.md, "Training step"): :func:`flag_set` reads a
flag (a bool, or any non-zero number as set); :func:`zeroed_when` the gradients a set flag zeroes;
:func:`all_finite` is the check of gradients and new values; :func:`skipped_updates` the updates
of a skipped step.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Sequence, Tuple

import jax
import jax.numpy as jnp

from jaxamp._src.core.marks import any_rows, any_set

__all__ = ["flag_set", "zeroed_when", "all_finite", "skipped_updates"]


def flag_set(flag: Any) -> jax.Array:
    """``bool[]``: whether a flag (a bool, or a number: any non-zero value, NaN included) is set."""
    flag = jnp.asarray(flag).reshape(())
    return flag if flag.dtype == jnp.bool_ else flag != 0


def zeroed_when(flags: Sequence[Any], grads: Any) -> Any:
    """``grads``, or zeros when one of ``flags`` (bools) is set: a select per leaf, which XLA fuses
    into each gradient's producer or consumer (no kernel of its own: a ``lax.cond`` would copy the
    gradients in each branch, a kernel per leaf on a GPU, docs/gpu.md)."""
    if not flags:
        return grads
    flagged = any_set(flags)
    return jax.tree_util.tree_map(lambda g: jnp.where(flagged, jnp.zeros_like(g), g), grads)


def all_finite(tree: Any) -> jax.Array:
    """``bool[]``: every inexact leaf of ``tree`` is finite (integer and bool leaves always are). The
    leaves widened to one dtype (exact: a widening keeps every value, inf and NaN included) and
    concatenated, then one check and reduction, which XLA fuses into one kernel (a batch's interior
    and boundary points: one kernel on a GPU where :func:`finite_both`'s padded codes take two,
    H100 program 4x512/6000; docs/gpu.md). Past ``marks.ROW_BOUND`` values, the reduction's second
    stage is an OR of its pieces fused into the consumers (``marks.any_rows``: one kernel, not two,
    at 44 000 values)."""
    leaves = [x for x in map(jnp.asarray, jax.tree_util.tree_leaves(tree)) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return jnp.bool_(True)
    wide = functools.reduce(jnp.promote_types, [x.dtype for x in leaves])
    flat = jnp.concatenate([x.astype(wide).reshape(-1) for x in leaves])
    return ~any_rows(flat, lambda x, _: ~jnp.isfinite(x), 1)[0]


def finite_both(first: Any, second: Any) -> Tuple[jax.Array, jax.Array]:
    """``(bool[], bool[])``: every inexact leaf of ``first`` is finite; of ``second``. One reduction:
    each leaf checked elementwise into a code (1: ``first`` non-finite there, 2: ``second``), the codes
    of one size OR-ed together, those of every other size padded with zeros to the largest size and
    OR-ed in (a few elementwise passes the length of the largest leaf, one per size), the result
    reduced once by a maximum. XLA fuses the checks, the ORs and the pads into what computes the
    leaves and into the reduction: on a GPU each reduction is a kernel or two (H100 program,
    4x512/6000: 5 kernels fewer than a reduction per shape)."""
    groups: Dict[int, jax.Array] = {}
    for bit, tree in ((1, first), (2, second)):
        for x in map(jnp.asarray, jax.tree_util.tree_leaves(tree)):
            if jnp.issubdtype(x.dtype, jnp.inexact):
                code = jnp.where(jnp.isfinite(x), jnp.uint8(0), jnp.uint8(bit)).reshape(-1)
                groups[code.size] = code if code.size not in groups else groups[code.size] | code
    if not groups:
        return jnp.bool_(True), jnp.bool_(True)
    n = max(groups)
    code = functools.reduce(jnp.bitwise_or, [jnp.pad(c, (0, n - c.size)) for c in groups.values()])
    code = jnp.max(code)
    return (code & 1) == 0, (code & 2) == 0


def skipped_updates(updates: Any) -> Any:
    """The updates of a skipped step: negative zeros, as ``x + (-0.0)`` is ``x`` bit for bit for every
    ``x`` (``+0.0`` would turn a ``-0.0`` parameter into ``+0.0``): ``optax.apply_updates`` then leaves
    the parameters exactly as they were, with no select of its own."""

    def zero(u: Any) -> Any:
        return jnp.full_like(u, -0.0) if jnp.issubdtype(jnp.result_type(u), jnp.inexact) else jnp.zeros_like(u)

    return jax.tree_util.tree_map(zero, updates)
