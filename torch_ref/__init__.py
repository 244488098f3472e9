"""torch_ref: a CPU/CUDA PyTorch reference of jaxamp's DerivScaler (docs/algorithm.md), in Modulus' idiom.

It stands alone (never imports jax or jaxamp) and mirrors jaxamp file for file:

  config:       AmpSettings, as_settings           (the Modulus ``amp:`` keys)
  scalers:      DynamicScaler, ScaleState, loss_scaler
  derivatives:  Derivatives, merge_found_inf, NONFINITE_VALUES (autograd.grad, create_graph=True)
  boundary:     Boundary, Scaling                  (the user's own autograd.grad through an fp16 module,
                                                    scaled per order: jaxamp's network boundary)
  training:     TrainState, make_train_step        (torch.optim + clip_grad_norm_)
  conversion:   flax_to_torch, torch_to_flax       (weight transfer, weight norm's (v, g)),
                scale_states_from_jax, scale_states_to_jax (scaler states, bit for bit)
  models:       torch_ref.models.FullyConnected
  per-tensor:   torch_ref.tensor_scale (scale_for, scaled_matmul)
"""

from torch_ref import models, tensor_scale
from torch_ref.boundary import Boundary, Scaling
from torch_ref.config import AmpSettings, as_settings
from torch_ref.convert import flax_to_torch, scale_states_from_jax, scale_states_to_jax, torch_to_flax
from torch_ref.derivatives import NONFINITE_VALUES, Derivatives, merge_found_inf
from torch_ref.scaler import DynamicScaler, ScaleState, loss_scaler
from torch_ref.train import (APPLIED, SKIP_DERIVATIVE_OVERFLOW, SKIP_NONFINITE_GRADS, SKIP_NONFINITE_VALUES, TrainState,
                             make_train_step)

__all__ = [
    "AmpSettings", "as_settings", "DynamicScaler", "ScaleState", "loss_scaler",
    "Derivatives", "merge_found_inf", "Boundary", "Scaling", "TrainState", "make_train_step", "APPLIED",
    "SKIP_DERIVATIVE_OVERFLOW", "SKIP_NONFINITE_GRADS", "SKIP_NONFINITE_VALUES", "NONFINITE_VALUES", "flax_to_torch",
    "torch_to_flax", "scale_states_from_jax", "scale_states_to_jax", "models", "tensor_scale",
]
