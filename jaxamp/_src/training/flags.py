"""The flag algebra of a train step (docs/algorithm.md, "Training step"): :func:`flag_set` reads a
flag (a bool, or any non-zero number as set); :func:`zeroed_when` the gradients a set flag zeroes;
:func:`all_finite` is the check of gradients and new values; :func:`skipped_updates` the updates
of a skipped step.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import jax
import jax.numpy as jnp

from jaxamp._src.core.evaluate import opaque
from jaxamp._src.core.marks import any_set

__all__ = ["flag_set", "zeroed_when", "all_finite", "skipped_updates"]


def flag_set(flag: Any) -> jax.Array:
    """``bool[]``: whether a flag (a bool, or a number: any non-zero value, NaN included) is set."""
    flag = jnp.asarray(flag).reshape(())
    return flag if flag.dtype == jnp.bool_ else flag != 0


def zeroed_when(flags: Sequence[Any], grads: Any) -> Any:
    """``grads``, or zeros when one of ``flags`` (bools) is set, as a ``lax.cond``: XLA writes the
    gradients out once and every consumer (a global norm, the finiteness check, each optimizer
    moment) reads them, where a select would be fused into each consumer with the gradients' last
    elementwise stage recomputed there. With no flags (plain float16, bfloat16) the clear flag
    passes an optimisation barrier, so the step compiles as a scaled one whose flags are clear
    (docs/algorithm.md, "How jaxamp computes it", one graph)."""
    flagged = any_set(flags) if flags else opaque({"clear": False}, bool)["clear"]
    return jax.lax.cond(flagged, lambda g: jax.tree_util.tree_map(jnp.zeros_like, g), lambda g: g, grads)


def all_finite(tree: Any) -> jax.Array:
    """``bool[]``: every inexact leaf of ``tree`` is finite (integer and bool leaves always are).
    The leaves of one shape and dtype are checked together, elementwise, then reduced once: a
    few reductions, each fused with what computes its leaves (a concatenation of the leaves would
    first write every one of them out)."""
    groups: Dict[Any, jax.Array] = {}
    for x in map(jnp.asarray, jax.tree_util.tree_leaves(tree)):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            key, ok = (x.shape, x.dtype), jnp.isfinite(x)
            groups[key] = ok if key not in groups else groups[key] & ok
    return ~any_set([~jnp.all(ok) for ok in groups.values()])


def skipped_updates(updates: Any) -> Any:
    """The updates of a skipped step: negative zeros, as ``x + (-0.0)`` is ``x`` bit for bit for every
    ``x`` (``+0.0`` would turn a ``-0.0`` parameter into ``+0.0``): ``optax.apply_updates`` then leaves
    the parameters exactly as they were, with no select of its own."""

    def zero(u: Any) -> Any:
        return jnp.full_like(u, -0.0) if jnp.issubdtype(jnp.result_type(u), jnp.inexact) else jnp.zeros_like(u)

    return jax.tree_util.tree_map(zero, updates)
