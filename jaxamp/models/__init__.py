"""Flax networks for PINNs with explicit mixed-precision placement."""

from jaxamp.models.fourier_net import FourierNet
from jaxamp.models.fully_connected import FullyConnected, WeightNormDense
from jaxamp.models.activations import ACTIVATIONS

__all__ = ["FourierNet", "FullyConnected", "WeightNormDense", "ACTIVATIONS"]
