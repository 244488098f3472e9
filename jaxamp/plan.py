"""What a custom point engine reads: ``jaxamp.Derivatives(..., method=engine)`` with
``engine(plan, f, x, scales) -> (values, scaled)`` (:data:`PointEngine`) gets the derivative
:class:`Plan` (names parsed by :func:`parse_name`); :func:`point_values` is the default
(forward) engine, e.g. ``functools.partial(point_values, series_min_order=...)``.

Public names of :mod:`jaxamp._src.derivatives.plan` and :mod:`jaxamp._src.derivatives.engine`.
"""

from jaxamp._src.derivatives.engine import PointEngine  # noqa: F401
from jaxamp._src.derivatives.forward_engine import point_values  # noqa: F401
from jaxamp._src.derivatives.plan import Plan, parse_name  # noqa: F401

__all__ = ["Plan", "parse_name", "PointEngine", "point_values"]
