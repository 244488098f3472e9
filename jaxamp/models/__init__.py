"""Flax networks for PINNs with explicit mixed-precision placement."""

from jaxamp.models.fully_connected import FullyConnected, WeightNormDense
from jaxamp.models.activations import ACTIVATIONS

__all__ = ["FullyConnected", "WeightNormDense", "ACTIVATIONS"]
