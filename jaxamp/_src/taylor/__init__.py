"""Taylor mode along one direction, order ``j`` carrying its scale ``S_j`` (docs/algorithm.md).

``K`` nested ``jax.jvp`` give ``2^K - 1`` chains (per-order seeds keep XLA from merging them);
Taylor mode propagates ``K`` coefficients per variable: :mod:`~jaxamp._src.taylor.rules`,
:mod:`~jaxamp._src.taylor.propagate` (the interpreter), :mod:`~jaxamp._src.taylor.faa_di_bruno` (the rule).
:func:`series`: orders ``1..K``; :func:`second_order`: ``K = 2`` by the ratio of the two seeds.
"""

from jaxamp._src.taylor.modes import second_order, series

__all__ = ["second_order", "series"]
