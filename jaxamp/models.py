"""Flax networks for PINNs with explicit mixed-precision placement.

Public names of :mod:`jaxamp._src.models` (the implementation).
"""

from jaxamp._src.models import FourierNet, FullyConnected

__all__ = ["FullyConnected", "FourierNet"]
