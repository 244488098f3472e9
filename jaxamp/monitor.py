"""Step metrics and the stall monitor.

Public names of :mod:`jaxamp._src.training.monitor` (the implementation).
"""

from jaxamp._src.training.monitor import (  # noqa: F401
    StallWarning, StallError, MonitorState, StallMonitor, opt_state_metrics,
)

__all__ = ['StallWarning', 'StallError', 'MonitorState', 'StallMonitor', 'opt_state_metrics']
