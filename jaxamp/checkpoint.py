"""Checkpoints of params, optimizer and scaler state (orbax).

Public names of :mod:`jaxamp._src.training.checkpoint` (the implementation).
"""

from jaxamp._src.training.checkpoint import (  # noqa: F401
    Checkpointer,
)

__all__ = ['Checkpointer']
