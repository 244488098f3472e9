"""Flax networks for PINNs with explicit mixed-precision placement.

Public names of :mod:`jaxamp._src.models` (the implementation).
"""

from jaxamp._src.models import (  # noqa: F401
    FourierNet, fourier_matrix, FullyConnected, WeightNormDense, ACTIVATIONS,
)

__all__ = ['FourierNet', 'fourier_matrix', 'FullyConnected', 'WeightNormDense', 'ACTIVATIONS']
