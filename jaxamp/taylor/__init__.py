"""Taylor-mode forward differentiation along one direction, one scale per order.

``K`` nested ``jax.jvp`` differentiate the whole tangent program again at every order (``2^K - 1``
chains, which DerivScaler's per-order seeds keep XLA from merging); Taylor mode propagates the
``K`` coefficients of every variable, order ``j`` carrying its scale ``S_j`` (docs/algorithm.md):
:mod:`~jaxamp.taylor.rules` (what is known about primitives), :mod:`~jaxamp.taylor.propagate`
(the interpreter) and :mod:`~jaxamp.taylor.faa_di_bruno` (the per-equation rule).

:func:`series` gives the pure derivatives of orders ``1..K``; :func:`second_order` is the same
rule for ``K = 2`` parametrised by the ratio of nested ``jax.jvp``'s two seeds (both compile to
the same program).
"""

from jaxamp.taylor.modes import second_order, series

__all__ = ["second_order", "series"]
