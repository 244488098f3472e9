"""Taylor mode along one direction, each order carrying its scale.

Public names of :mod:`jaxamp._src.taylor` (the implementation).
"""

from jaxamp._src.taylor import (  # noqa: F401
    second_order, series,
)

__all__ = ['second_order', 'series']
