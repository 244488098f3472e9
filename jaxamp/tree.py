"""Small pytree helpers used by the scalers and the train step (branch-free, jit-safe)."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp

T = TypeVar("T")


def all_finite(tree: Any) -> jax.Array:
    """``bool[]``: True when every floating leaf of ``tree`` is free of inf and NaN."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def any_true(flags: Any) -> jax.Array:
    """``bool[]``: logical OR over every leaf of a pytree of booleans (False when empty)."""
    leaves = jax.tree_util.tree_leaves(flags)
    if not leaves:
        return jnp.asarray(False)
    return jnp.stack([jnp.asarray(x, bool).reshape(()) for x in leaves]).any()


def select_tree(pred: jax.Array, on_true: T, on_false: T) -> T:
    """Pick ``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf.

    Both trees must have the same structure. The unselected tree may hold inf/NaN: the
    result never mixes them in (``jnp.where`` selects, it does not blend).
    """
    pred = jnp.asarray(pred, bool)
    if pred.shape != ():
        raise ValueError(f"select_tree: `pred` must be a scalar bool, got shape {pred.shape}.")
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
