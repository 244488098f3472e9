"""Equinox and Flax NNX modules as arguments: detection and filter semantics.

Neither library is a dependency: a module is recognised only when its library is imported
already (``sys.modules``). :func:`filter_grad` gives :func:`jaxamp.value_and_grad` the
semantics of ``eqx.filter_value_and_grad`` for an argument holding a module: its inexact array
leaves are differentiated, every other leaf (an activation function, an int array, a Python
number) is held static, and the gradient has the argument's structure with ``None`` there.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["is_module", "holds_module", "filter_grad"]


def _module_types() -> Tuple[type, ...]:
    types = []
    eqx = sys.modules.get("equinox")
    if eqx is not None and hasattr(eqx, "Module"):
        types.append(eqx.Module)
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and hasattr(nnx, "Module"):
        types.append(nnx.Module)
    return tuple(types)


def is_module(x: Any) -> bool:
    """Whether ``x`` is an Equinox or a Flax NNX module, or a method bound to one (Equinox's
    bound methods are modules themselves)."""
    types = _module_types()
    return bool(types) and (isinstance(x, types) or isinstance(getattr(x, "__self__", None), types))


def holds_module(tree: Any) -> bool:
    """Whether the pytree ``tree`` is or contains an Equinox / NNX module."""
    types = _module_types()
    if not types:
        return False
    return any(isinstance(leaf, types) for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_module))


def _inexact_array(x: Any) -> bool:
    """``eqx.is_inexact_array``: a JAX or NumPy array of a floating or complex dtype."""
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.inexact)


def filter_grad(make_grad: Callable[..., Callable], fun: Callable[..., Any], argnums: Union[int, Sequence[int]],
                *extra: Any) -> Callable[..., Tuple[Any, Any]]:
    """``make_grad(fun, argnums, *extra)`` (a ``jax.grad(..., has_aux=True)``-like ``g(*args) -> (grads,
    aux)``) with filter semantics: each differentiated argument holding a module is passed to
    ``g`` as the list of its leaves, ``None`` at those that are not inexact arrays (held static:
    ``fun`` gets the argument rebuilt), and its gradient is given the argument's structure,
    ``None`` at the static leaves (as ``eqx.filter_value_and_grad``). Other arguments: as
    ``make_grad``, so a params dict is differentiated exactly as ``jax.grad`` does."""

    def g(*args: Any) -> Tuple[Any, Any]:
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        parts, flat_args = {}, list(args)
        for i in nums:
            if isinstance(i, int) and -len(args) <= i < len(args) and holds_module(args[i]):
                leaves, treedef = jax.tree_util.tree_flatten(args[i])
                mask = [_inexact_array(leaf) for leaf in leaves]
                parts[i % len(args)] = (leaves, treedef, mask)
                flat_args[i] = [leaf if m else None for leaf, m in zip(leaves, mask)]
        if not parts:
            return make_grad(fun, argnums, *extra)(*args)

        def rebuilt(*a: Any) -> Any:
            a = list(a)
            for i, (leaves, treedef, mask) in parts.items():
                a[i] = jax.tree_util.tree_unflatten(treedef, [d if m else s for d, s, m in zip(a[i], leaves, mask)])
            return fun(*a)

        def restore(i: int, grad: Any) -> Any:
            if i % len(args) not in parts:
                return grad
            _, treedef, mask = parts[i % len(args)]
            return jax.tree_util.tree_unflatten(treedef, [d if m else None for d, m in zip(grad, mask)])

        grads, aux = make_grad(rebuilt, argnums, *extra)(*flat_args)
        grads = restore(argnums, grads) if isinstance(argnums, int) else tuple(map(restore, nums, grads))
        return grads, aux

    return g
