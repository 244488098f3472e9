"""TrainState and make_train_step: value_and_grad + optimizer in one jitted step.

Public names of :mod:`jaxamp._src.training.train` (the implementation).
"""

from jaxamp._src.training.train import (  # noqa: F401
    Step, TrainState, step_metrics, make_train_step,
)

__all__ = ['Step', 'TrainState', 'step_metrics', 'make_train_step']
