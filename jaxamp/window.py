"""float16's window: value ranges, the profile, and start scales recommended from it.

Public names of :mod:`jaxamp._src.core.window` (the implementation).
"""

from jaxamp._src.core.window import (  # noqa: F401
    FP16_MAX, Range, Profile, Recommendation, value_range, check_margin, recommend, LEGEND,
    format_profile,
)

__all__ = ['FP16_MAX', 'Range', 'Profile', 'Recommendation', 'value_range', 'check_margin', 'recommend', 'LEGEND', 'format_profile']
