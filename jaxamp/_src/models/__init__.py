"""Flax networks for PINNs with explicit mixed-precision placement."""

from jaxamp._src.models.fourier_net import FourierNet, fourier_matrix
from jaxamp._src.models.fully_connected import FullyConnected, WeightNormDense
from jaxamp._src.models.activations import ACTIVATIONS

__all__ = ["FourierNet", "fourier_matrix", "FullyConnected", "WeightNormDense", "ACTIVATIONS"]
