"""Per-tensor scaled products read operands held in their format through a widening cast.

A matmul operand already held in its format keeps scale 1 (:mod:`jaxamp._src.placement.tensor_scale`:
its products are exact in the float32 accumulator, so a scale could only lose bits, and it
costs no amax). After differentiation such operands often reach ``scaled_dot_p`` widened: the
cotangent of a float16 activation arrives as ``convert(c16 -> float32)``, the transpose of the
cast that lowered the activation. The transpose rule sees an array, not where it came from;
:func:`held_operands` reads the traced program instead and hands each ``scaled_dot_p`` the
narrow value wherever its operand is the role's format widened. The product bits are those the
widened operand gives at any scale that keeps it in the format's normal range.

``jaxamp.value_and_grad`` (and so ``make_train_step``) runs it over the gradient program when
per-tensor scaling is on; anywhere else the operand takes its amax, with the same product.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxamp._src.core.interpreter import bind, eval_jaxpr, sub_jaxpr, trace
from jaxamp._src.placement.tensor_scale import scaled_dot_p
from jaxamp._src.scaling.config_values import ROLES
from jaxamp._src.taylor.rules import INLINED_CALLS

__all__ = ["held_operands"]

class _Held(NamedTuple):
    x: Any  # the value as the program has it
    narrow: Optional[Any] = None  # the same value in the narrower float it was widened from


def _rule(eqn: jcore.JaxprEqn, invals: List[_Held]) -> List[_Held]:
    name = eqn.primitive.name
    if name in INLINED_CALLS:  # entered; a rematerialised body is left as written
        body = sub_jaxpr(eqn)
        if body is not None:
            return eval_jaxpr(body.jaxpr, [_Held(c) for c in body.consts], invals, _rule, literal=_Held)
    xs = [v.x for v in invals]
    if name == "jaxamp_scaled_dot":
        fmt = jnp.dtype(eqn.params["formats"][ROLES.index(eqn.params["role"])])
        xs = [v.narrow if v.narrow is not None and v.narrow.dtype == fmt else v.x for v in invals]
        return [_Held(scaled_dot_p.bind(*xs, **eqn.params))]
    outs = bind(eqn, xs)
    if name == "convert_element_type" and _widens(jnp.result_type(xs[0]), outs[0].dtype):
        return [_Held(outs[0], xs[0])]
    return [_Held(o) for o in outs]


def _widens(source: Any, target: Any) -> bool:
    floats = jnp.issubdtype(source, jnp.floating) and jnp.issubdtype(target, jnp.floating)
    return floats and jnp.finfo(source).bits < jnp.finfo(target).bits


def held_operands(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` traced once and evaluated with every ``scaled_dot_p`` given the narrow form of an
    operand that is its role's format widened (held in it: scale 1, no amax).

    Args:
      fun: any function of pytrees of arrays.

    Returns:
      A function with ``fun``'s signature and values.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp.tensor_scale import scaled_dot
      >>> f = lambda c, w: scaled_dot(c.astype(jnp.float32), w, (((1,), (0,)), ((), ())))
      >>> c, w = jnp.ones((2, 3), jnp.float16), jnp.ones((3, 2))
      >>> bool((held_operands(f)(c, w) == f(c, w)).all())
      True
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        closed, flat, out_tree = trace(fun, args, kwargs)
        outs = eval_jaxpr(closed.jaxpr, [_Held(c) for c in closed.consts], [_Held(a) for a in flat], _rule,
                          literal=_Held)  # fmt: skip
        return jax.tree_util.tree_unflatten(out_tree, [o.x for o in outs])

    return run
