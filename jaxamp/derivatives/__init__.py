"""Scaled input derivatives of a per-point network: the DerivScaler's derivative engine.

A derivative is named like Modulus: ``u__x`` is du/dx, ``u__x__y`` is d/dy(du/dx). The
engine computes every requested derivative of a per-point function with nested AD and
``vmap`` over points, each differentiation following docs/algorithm.md "One derivative step":

1. multiply the differentiated variable by its scaler's scale (the backward seed; in forward
   mode the tangent seed, which scales every float16 tangent the same way);
2. differentiate through the network's mixed-precision graph;
3. check the *scaled* result: an overflow flags the scaler's key, bad values flag
   :data:`jaxamp.NONFINITE_VALUES` (the marks of :mod:`jaxamp.marks`, interpreted by :func:`jaxamp.scaled`);
4. multiply by ``1/scale`` in float32, inside the differentiable graph.

Modules: :mod:`~jaxamp.derivatives.engine` (:class:`jaxamp.Derivatives`), :mod:`~jaxamp.derivatives.plan` (names, levels, paths, scaler keys: the one plan
every engine reads), :mod:`~jaxamp.derivatives.forward` (the default engine);
``method="reverse"`` is nested :func:`jaxamp.grad` (the reference path). The engine writes
the derivative program; :func:`jaxamp.scaled` (and :func:`jaxamp.value_and_grad`, the train
step) gives it its scales and collects its flags, as for the drop-in derivatives.
"""
