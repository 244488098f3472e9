"""The dynamic scaler rule and the scaler states of a run.

Public names of :mod:`jaxamp._src.scaling.scaler` (the implementation).
"""

from jaxamp._src.scaling.scaler import (  # noqa: F401
    DynamicScaler, ScaleState, Scalers, loss_scaler, LOSS_SCALER_DEFAULTS, exact_log2,
)

__all__ = ['DynamicScaler', 'ScaleState', 'Scalers', 'loss_scaler', 'LOSS_SCALER_DEFAULTS', 'exact_log2']
