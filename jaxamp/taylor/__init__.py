"""Taylor-mode forward differentiation along one direction, one scale per order.

A pure derivative ``d^K f/dx^K`` by ``K`` nested ``jax.jvp`` differentiates the whole
tangent program again at every order: ``2^K - 1`` tangent chains, whose seeds differ under
DerivScaler's per-order scaling (docs/algorithm.md), so XLA cannot merge them. Taylor mode
propagates ``K`` chains, the Taylor coefficients of orders ``1..K`` of every variable of
``f``, order ``j`` carrying its scale ``S_j``:

- :mod:`jaxamp.taylor.rules`: what the interpreter knows about primitives (linear, bilinear,
  polynomial degree, call-like);
- :mod:`jaxamp.taylor.propagate`: the propagation, :func:`jaxamp.interpreter.eval_jaxpr` over
  (value, coefficients) pairs with a per-equation rule;
- :mod:`jaxamp.taylor.faa_di_bruno`: that rule, Faa di Bruno's formula with the scales.

:func:`series` is the pure derivatives of orders ``1..K``; :func:`second_order` is the same
propagation for ``K = 2`` parametrised by the ratio of nested ``jax.jvp``'s two seeds. There
is one implementation of the pure second order: ``series(order=2)`` and ``second_order``
build the same rule and compile to the same program (float32 primitives scale the product
``d2f[t, t]`` after it; float16 primitives rescale both tangents by powers of two before it,
as at every order), so the forward engine may use either.
"""

from jaxamp.taylor.modes import second_order, series

__all__ = ["second_order", "series"]
