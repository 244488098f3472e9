"""The step's pieces: the check of a step's flags, the skip decision and the scaler update.

Public names of :mod:`jaxamp._src.training.step` (the implementation).
"""

from jaxamp._src.training.optim import with_amp_state  # noqa: F401
from jaxamp._src.training.step import (  # noqa: F401
    SkipReason, StepCheck, Flags, StepFlags, AmpOptState, check_step, update_scalers,
    find_opt_state, with_opt_state,
)

__all__ = ['SkipReason', 'StepCheck', 'Flags', 'StepFlags', 'AmpOptState', 'check_step', 'update_scalers', 'find_opt_state', 'with_opt_state', 'with_amp_state']
