"""jaxamp: automatic mixed precision with derivative scaling for physics-informed networks.

The public API (docs/algorithm.md describes the algorithm; each name has its docstring):

  settings:     AmpConfig, ConfigError, DynamicScaler
  state:        AmpState, init (the one way to create it), UnscaledDerivativeWarning
  train step:   value_and_grad, apply_or_skip, optimizer (optax), SkipReason
  derivatives:  grad, jacrev, jacfwd, jvp, hessian, laplacian, scaled (interprets them),
                profile (their ranges in float16's window), NONFINITE_VALUES (the bad-values key)
  networks:     autocast (precision placement for any network)
  engine:       Derivatives (named derivatives of a per-point network)

Modules for more: :mod:`jaxamp.models` (FullyConnected, FourierNet), :mod:`jaxamp.train`
(TrainState, make_train_step for Derivatives engines), :mod:`jaxamp.window` (Range,
recommend, format_profile), :mod:`jaxamp.parallel`, :mod:`jaxamp.checkpoint`, :mod:`jaxamp.monitor`,
:mod:`jaxamp.step` (the step's pieces), :mod:`jaxamp.scaler`.
"""

from jaxamp import checkpoint, marks, models, monitor, parallel, scaler, step, train, window  # noqa: F401
from jaxamp.config import AmpConfig, ConfigError
from jaxamp.engine import Derivatives
from jaxamp.dropin.forward import hessian, jacfwd, jvp
from jaxamp.dropin.grad import grad, jacrev
from jaxamp.dropin.laplacian import laplacian
from jaxamp.dropin.ranges import profile
from jaxamp.dropin.scaled import scaled
from jaxamp.marks import NONFINITE_VALUES
from jaxamp.optim import apply_or_skip, optimizer, value_and_grad
from jaxamp.placement.rewrite import autocast
from jaxamp.scaler import DynamicScaler
from jaxamp.start import UnscaledDerivativeWarning, init
from jaxamp.state import AmpState
from jaxamp.step import SkipReason

__version__ = "0.1.0"

__all__ = [
    "AmpConfig",
    "ConfigError",
    "DynamicScaler",
    "AmpState",
    "init",
    "UnscaledDerivativeWarning",
    "value_and_grad",
    "apply_or_skip",
    "optimizer",
    "SkipReason",
    "grad",
    "jacrev",
    "jacfwd",
    "jvp",
    "hessian",
    "laplacian",
    "scaled",
    "profile",
    "NONFINITE_VALUES",
    "autocast",
    "Derivatives",
]
