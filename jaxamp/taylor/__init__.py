"""Taylor-mode forward differentiation of a traced function along one direction.

:func:`second_order` gives a pure second derivative with one propagated tangent chain;
:func:`series` gives pure derivatives of any order, one chain and one scale per order.
"""

from jaxamp.taylor.curvature import second_order
from jaxamp.taylor.faa_di_bruno import partitions, series

__all__ = ["partitions", "second_order", "series"]
