"""Per-tensor power-of-two scaling of matmul operands (float16 and FP8).

Public names of :mod:`jaxamp._src.placement.tensor_scale` (the implementation).
"""

from jaxamp._src.placement.tensor_scale import (  # noqa: F401
    ROLES, FP8_FORMATS, MARGIN_LOG2, scale_for, scaled_dot, scaled_dot_p,
)

__all__ = ['ROLES', 'FP8_FORMATS', 'MARGIN_LOG2', 'scale_for', 'scaled_dot', 'scaled_dot_p']
