"""jaxamp: automatic mixed precision with derivative scaling for physics-informed networks.

Public API:
  config:       AmpConfig, ConfigError
  scalers:      DynamicScaler, ScaleState, derivative_scaler, loss_scaler
  derivatives:  Derivatives
  precision:    get_policy
  training:     TrainState, make_train_step, merge_found_inf, clip_by_global_norm
  checkpoints:  Checkpointer
  helpers:      all_finite, any_true, select_tree
  models:       jaxamp.models.FullyConnected, jaxamp.models.FourierNet
  devices:      jaxamp.parallel (make_mesh, shard_batch, replicate, data_parallel_step)
"""

from jaxamp import models, parallel
from jaxamp.checkpoint import Checkpointer
from jaxamp.config import AmpConfig, ConfigError
from jaxamp.derivatives import Derivatives
from jaxamp.policy import get_policy
from jaxamp.scaler import DynamicScaler, ScaleState, derivative_scaler, loss_scaler
from jaxamp.train import (
    APPLIED,
    SKIP_DERIVATIVE_OVERFLOW,
    SKIP_NONFINITE_GRADS,
    TrainState,
    clip_by_global_norm,
    make_train_step,
    merge_found_inf,
)
from jaxamp.tree import all_finite, any_true, select_tree

__version__ = "0.1.0"

__all__ = [
    "AmpConfig",
    "ConfigError",
    "DynamicScaler",
    "ScaleState",
    "derivative_scaler",
    "loss_scaler",
    "Derivatives",
    "get_policy",
    "TrainState",
    "make_train_step",
    "merge_found_inf",
    "clip_by_global_norm",
    "APPLIED",
    "SKIP_DERIVATIVE_OVERFLOW",
    "SKIP_NONFINITE_GRADS",
    "Checkpointer",
    "all_finite",
    "any_true",
    "select_tree",
    "models",
    "parallel",
]
