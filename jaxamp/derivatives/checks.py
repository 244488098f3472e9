"""Step 3 of docs/algorithm.md "One derivative step": the flags of a derivative engine.

A scaler key is flagged only for a true *overflow*: at some point the level below a derivative
(its inputs and every value on its path) is finite and the scaled result of the step is not;
backing that key's scale off can cure it. Non-finite inputs or network outputs are *bad
values*, reported under :data:`NONFINITE_VALUES`: no scale can cure them. Any other
non-finite value has a non-finite value below it, which is one of the two.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import jax
import jax.numpy as jnp

from jaxamp.derivatives.plan import Plan, parent_of
from jaxamp.marks import NONFINITE_VALUES, or_into, step_flags


def found_inf(plan: Plan, x: jax.Array, values: Mapping[str, jax.Array], scaled: Mapping[str, jax.Array],
              weights: Optional[jax.Array] = None) -> Dict[str, jax.Array]:  # fmt: skip
    """``{key: bool[]}`` for every step key, plus :data:`NONFINITE_VALUES`, over a batch.

    Args:
      plan: the engine's plan.
      x: the points, ``f32[N, n_inputs]``.
      values: ``{name: f32[N]}`` unscaled, every output and derivative.
      scaled: ``{derivative: f32[N]}``, the scaled result of each derivative's last step.
      weights: ``f32[N]``, points with weight 0 raise no flag (None: every point counts).
    """
    counted = jnp.ones(x.shape[:1], bool) if weights is None else weights > 0
    below_ok = {o: jnp.all(jnp.isfinite(x), axis=-1) for o in plan.outputs}
    bad = ~below_ok[plan.outputs[0]]
    for o in plan.outputs:
        bad = bad | ~jnp.isfinite(values[o])
    per_point: Dict[str, jax.Array] = {}
    for name in plan.derivatives:
        parent = parent_of(name)
        below_ok[name] = below_ok[parent] & jnp.isfinite(values[parent])
        or_into(per_point, plan.paths[name][-1][0], step_flags(scaled[name], below_ok[name]))
    per_point[NONFINITE_VALUES] = bad
    return {key: jnp.any(hit & counted) for key, hit in per_point.items()}
