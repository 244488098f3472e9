"""The reverse engine (``method="reverse"``): nested ``jax.grad``, as Modulus' autograd.

The reference path of the torch parity tests. Each differentiated variable gets one reverse
pass, its gradient with respect to every input at once; the pass differentiates the variable's
scaled, then unscaled graph (docs/algorithm.md, "One derivative step"), so higher orders see
the lower orders' ``1/scale``. Unscaled engines run this same code with every scale 1.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Tuple

import jax
import jax.numpy as jnp

from jaxamp.derivatives.plan import Plan, parent_of, parse_name
from jaxamp.marks import seed, unscale


def point_values(plan: Plan, f: Callable[[jax.Array], jax.Array], x: jax.Array,
                 scales: Mapping[str, jax.Array]) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:  # fmt: skip
    """Every value of ``plan`` at one point by nested reverse mode.

    Args:
      plan: the engine's plan.
      f: the network at one point, ``x: f32[n_inputs] -> f32[n_outputs]``.
      x: the point.
      scales: ``{key: f32[]}`` for every key of ``plan.step_keys``.

    Returns:
      ``(values, scaled)`` as :func:`jaxamp.derivatives.forward.point_values`.
    """
    fns = _VariableFns(plan, f, scales)
    y = f(x)
    values = {name: y[i] for i, name in enumerate(plan.outputs)}
    scaled: Dict[str, jax.Array] = {}
    for level in plan.levels:
        for p, parent in enumerate(level.parents):
            children = [(n, col) for n, cp, col in zip(level.names, level.child_parent, level.child_input) if cp == p]
            grad = fns.scaled_grad(parent)(x)  # steps 1-2: f32[n_inputs], scaled
            for name, col in children:
                scaled[name] = grad[col]
                values[name] = unscale(grad[col], fns.inv_scale(parent))  # step 4: unscale in f32
    return values, scaled


class _VariableFns:
    """Per-point functions of ``x`` for every variable the engine needs, built once per trace.

    ``value(name)(x)`` is the unscaled value of a variable (an output or a derivative);
    ``scaled_grad(name)(x)`` is ``grad(scale * value(name))(x)``, the scaled gradient with
    respect to every input. Indices are static, so no gather/scatter enters the graph.
    """

    def __init__(self, plan: Plan, f: Callable[[jax.Array], jax.Array], scales: Mapping[str, jax.Array]) -> None:
        self.plan, self.f, self.scales = plan, f, scales
        self.keys = {p: k for level in plan.levels for p, k in zip(level.parents, level.parent_keys)}
        self._values: Dict[str, Callable] = {}
        self._grads: Dict[str, Callable] = {}

    def scale(self, name: str) -> jax.Array:
        return self.scales[self.keys[name]]

    def inv_scale(self, name: str) -> jax.Array:
        return jnp.float32(1.0) / self.scale(name)

    def value(self, name: str) -> Callable[[jax.Array], jax.Array]:
        if name not in self._values:
            if name in self.plan.outputs:
                i = self.plan.outputs.index(name)
                fn = lambda x: self.f(x)[i]  # noqa: E731
            else:
                parent = parent_of(name)
                col, grad = self.plan.inputs.index(parse_name(name)[1][-1]), self.scaled_grad(parent)
                fn = lambda x: unscale(grad(x)[col], self.inv_scale(parent))  # noqa: E731
            self._values[name] = fn
        return self._values[name]

    def scaled_grad(self, name: str) -> Callable[[jax.Array], jax.Array]:
        if name not in self._grads:
            value = self.value(name)
            self._grads[name] = jax.grad(lambda x: seed(value(x), self.scale(name)))
        return self._grads[name]
