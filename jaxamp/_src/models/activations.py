"""Activations by name, evaluated in a chosen dtype."""

from __future__ import annotations

from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp

__all__ = ["ACTIVATIONS", "check_activation", "apply_activation"]

ACTIVATIONS: Dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "gelu": jax.nn.gelu,
    "identity": lambda x: x,
}


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported: expected one of {sorted(ACTIVATIONS)}.")


def apply_activation(name: str, x: jax.Array, eval_dtype: Optional[jnp.dtype]) -> jax.Array:
    """``act(x)`` evaluated in ``eval_dtype`` (None: ``x``'s own) and cast back to ``x.dtype``."""
    fn = ACTIVATIONS[name]
    if eval_dtype is None or jnp.dtype(eval_dtype) == x.dtype:
        return fn(x)
    return fn(x.astype(eval_dtype)).astype(x.dtype)
