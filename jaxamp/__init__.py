"""jaxamp: automatic mixed precision with derivative scaling for physics-informed networks.

Public API (docs/algorithm.md describes the algorithm):

  config:       AmpConfig, ConfigError
  scalers:      DynamicScaler, ScaleState, Scalers
  derivatives:  Derivatives, merge_found_inf
  step pieces:  scaled_value_and_grad, check_step, update_scalers
                (skip reasons APPLIED, SKIP_NONFINITE_VALUES, SKIP_DERIVATIVE_OVERFLOW, SKIP_NONFINITE_GRADS)
  training:     TrainState, make_train_step
  run safety:   Checkpointer, StallMonitor
  drop-in:      grad, jacrev, jacfwd, jvp, hessian, scaled (on existing jax.grad code), autocast (placement
                for any network); jaxamp.dropin.profile / init_scalers (start scales from a profile)
  range:        jaxamp.profile (profile, recommend: where every derivative sits in float16's window);
                headroom_log2, headroom_metrics (per scaler key, from the values a step already has)
  modules:      jaxamp.models (FullyConnected, FourierNet), jaxamp.parallel (make_mesh, shard_batch, ...)
"""

from jaxamp import dropin, models, parallel, profile
from jaxamp.autocast import autocast
from jaxamp.checkpoint import Checkpointer
from jaxamp.config import AmpConfig, ConfigError
from jaxamp.derivatives import Derivatives
from jaxamp.dropin import grad, hessian, jacfwd, jacrev, jvp, scaled
from jaxamp.headroom import headroom_log2, headroom_metrics
from jaxamp.monitor import StallMonitor
from jaxamp.scaler import DynamicScaler, Scalers, ScaleState
from jaxamp.step import (
    APPLIED,
    SKIP_DERIVATIVE_OVERFLOW,
    SKIP_NONFINITE_GRADS,
    SKIP_NONFINITE_VALUES,
    check_step,
    merge_found_inf,
    scaled_value_and_grad,
    update_scalers,
)
from jaxamp.train import TrainState, make_train_step

__version__ = "0.1.0"

__all__ = [
    "AmpConfig",
    "ConfigError",
    "DynamicScaler",
    "ScaleState",
    "Scalers",
    "Derivatives",
    "merge_found_inf",
    "headroom_log2",
    "headroom_metrics",
    "scaled_value_and_grad",
    "check_step",
    "update_scalers",
    "APPLIED",
    "SKIP_NONFINITE_VALUES",
    "SKIP_DERIVATIVE_OVERFLOW",
    "SKIP_NONFINITE_GRADS",
    "TrainState",
    "make_train_step",
    "Checkpointer",
    "StallMonitor",
    "grad",
    "jacrev",
    "jacfwd",
    "jvp",
    "hessian",
    "scaled",
    "autocast",
    "dropin",
    "profile",
    "models",
    "parallel",
]
