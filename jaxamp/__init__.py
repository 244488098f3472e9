"""jaxamp: automatic mixed precision with derivative scaling for physics-informed networks.

The public API (docs/algorithm.md describes the algorithm; each name has its docstring):

  settings:     AmpConfig, ConfigError
  state:        AmpState, init (the one way to create it), UnscaledDerivativeWarning
  train step:   value_and_grad, optimizer (optax), apply_or_skip, grad_norms (loss weights), SkipReason
  derivatives:  grad, jacrev, jacfwd, jvp, hessian, laplacian, scaled (interprets them),
                profile (their ranges in float16's window; its result recommends start scales),
                NONFINITE_VALUES (the bad-values key)
  networks:     autocast (precision placement for any network), Derivatives (named derivatives
                of a per-point network)
  a whole loop: TrainState, make_train_step, StallMonitor, StallWarning, StallError, Checkpointer

Public modules: :mod:`jaxamp.models` (FullyConnected, FourierNet) and :mod:`jaxamp.parallel`
(make_mesh, shard_batch, replicate, data_parallel_step). The implementation lives in ``jaxamp._src`` (no
stable names there).
"""

from jaxamp import models, parallel  # noqa: F401
from jaxamp._src.core.marks import NONFINITE_VALUES
from jaxamp._src.core.profile import profile
from jaxamp._src.core.scaled import scaled
from jaxamp._src.derivatives.engine import Derivatives
from jaxamp._src.derivatives.forward import hessian, jacfwd, jvp
from jaxamp._src.derivatives.grad import grad, jacrev
from jaxamp._src.derivatives.laplacian import laplacian
from jaxamp._src.placement.rewrite import autocast
from jaxamp._src.scaling.config import AmpConfig, ConfigError
from jaxamp._src.scaling.state import AmpState
from jaxamp._src.training.checkpoint import Checkpointer
from jaxamp._src.training.monitor import StallError, StallMonitor, StallWarning
from jaxamp._src.training.optim import apply_or_skip, grad_norms, optimizer, value_and_grad
from jaxamp._src.training.start import UnscaledDerivativeWarning, init
from jaxamp._src.training.step import SkipReason
from jaxamp._src.training.train import TrainState, make_train_step

__version__ = "0.1.0"

# The public classes print under the name users import them by (jaxamp.AmpConfig, not their home
# in jaxamp._src), in reprs and error messages alike.
for _public in (AmpConfig, ConfigError, AmpState, Derivatives, SkipReason, UnscaledDerivativeWarning,
                TrainState, StallMonitor, StallWarning, StallError, Checkpointer):
    _public.__module__ = __name__
del _public

__all__ = [
    "AmpConfig",
    "ConfigError",
    "AmpState",
    "init",
    "UnscaledDerivativeWarning",
    "value_and_grad",
    "grad_norms",
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
    "TrainState",
    "make_train_step",
    "StallMonitor",
    "StallWarning",
    "StallError",
    "Checkpointer",
]
