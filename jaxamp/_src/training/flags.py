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

from jaxamp._src.core.marks import any_set

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
    """``bool[]``: every inexact leaf of ``tree`` is finite (integer and bool leaves always are)."""
    return finite_both(tree, ())[0]


def finite_both(first: Any, second: Any) -> Tuple[jax.Array, jax.Array]:
    """``(bool[], bool[])``: every inexact leaf of ``first`` is finite; of ``second``. One pass: the
    leaves of one shape and dtype are checked together, elementwise, into a code (1: ``first``
    non-finite there, 2: ``second``), reduced once per shape by a maximum, each fused with what
    computes its leaves (a concatenation would first write every leaf out); then the few codes."""
    groups: Dict[Any, jax.Array] = {}
    for bit, tree in ((1, first), (2, second)):
        for x in map(jnp.asarray, jax.tree_util.tree_leaves(tree)):
            if jnp.issubdtype(x.dtype, jnp.inexact):
                key, code = (x.shape, x.dtype), jnp.where(jnp.isfinite(x), jnp.uint8(0), jnp.uint8(bit))
                groups[key] = code if key not in groups else groups[key] | code
    if not groups:
        return jnp.bool_(True), jnp.bool_(True)
    code = functools.reduce(jnp.bitwise_or, [jnp.max(c) for c in groups.values()])
    return (code & 1) == 0, (code & 2) == 0


def skipped_updates(updates: Any) -> Any:
    """The updates of a skipped step: negative zeros, as ``x + (-0.0)`` is ``x`` bit for bit for every
    ``x`` (``+0.0`` would turn a ``-0.0`` parameter into ``+0.0``): ``optax.apply_updates`` then leaves
    the parameters exactly as they were, with no select of its own."""

    def zero(u: Any) -> Any:
        return jnp.full_like(u, -0.0) if jnp.issubdtype(jnp.result_type(u), jnp.inexact) else jnp.zeros_like(u)

    return jax.tree_util.tree_map(zero, updates)
