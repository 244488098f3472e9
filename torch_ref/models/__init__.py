"""torch networks mirroring ``jaxamp.models``."""

from torch_ref.models.fully_connected import ACTIVATIONS, FullyConnected, WeightNormLinear

__all__ = ["FullyConnected", "WeightNormLinear", "ACTIVATIONS"]
