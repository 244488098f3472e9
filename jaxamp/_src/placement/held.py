"""Per-tensor scaled products read operands held in their format through a widening cast.

A matmul operand already held in its format keeps scale 1 (:mod:`jaxamp._src.placement.tensor_scale`:
its products are exact in the float32 accumulator, so a scale could only lose bits, and it
costs no amax). In a program such operands reach ``scaled_dot_p`` widened: ``jaxamp.autocast``
casts a float16 activation back to its float32 dtype before the next matmul reads it, and after
differentiation the cotangent of a float16 activation arrives as ``convert(c16 -> float32)``,
the transpose of that cast. The primitive sees an array, not where it came from; this pass reads
the traced program and hands each ``scaled_dot_p`` the narrow value wherever its operand is the
role's format widened. The product bits are those the widened operand gives at any scale that
keeps it in the format's normal range.

One pass, two callers: ``jaxamp.autocast`` evaluates its placed program through it with
``sole_readers=True`` (the program may be differentiated later: only a widened value that the
product alone reads is replaced, so the product's cotangent is rounded to the format once, as
the cast's transpose would, and never summed in it with another reader's), and
``jaxamp.value_and_grad`` runs it over the gradient program (nothing differentiates it again:
every reader is replaced) when per-tensor scaling is on.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

from jaxamp._src.core.interpreter import bind, eval_jaxpr, sub_jaxpr, trace
from jaxamp._src.placement.tensor_scale import scaled_dot_p
from jaxamp._src.scaling.config_values import ROLES

__all__ = ["evaluate_held", "held_operands"]

class _Held(NamedTuple):
    x: Any  # the value as the program has it
    narrow: Optional[Any] = None  # the same value in the narrower float it was widened from


def _rule(sole_readers: bool) -> Callable:
    def rule(eqn: jcore.JaxprEqn, invals: List[_Held], uses: Dict[Any, int]) -> List[_Held]:
        prim = eqn.primitive
        body = sub_jaxpr(eqn)  # a call is entered; a rematerialised body is left as written
        if body is not None:  # readers are counted per jaxpr: a value read outside too enters plain
            if sole_readers:
                invals = [v if uses.get(var) == 1 else _Held(v.x) for v, var in zip(invals, eqn.invars)]
            return _evaluate(body.jaxpr, [_Held(c) for c in body.consts], invals, sole_readers)
        xs = [v.x for v in invals]
        if prim is scaled_dot_p:
            fmt = jnp.dtype(eqn.params["formats"][ROLES.index(eqn.params["role"])])
            def operand(v: Any, var: Any) -> Any:  # its held form where this product may read it
                held = v.narrow is not None and v.narrow.dtype == fmt
                return v.narrow if held and (not sole_readers or uses.get(var) == 1) else v.x

            xs = [operand(v, var) for v, var in zip(invals, eqn.invars)]
            return [_Held(scaled_dot_p.bind(*xs, **eqn.params))]
        outs = bind(eqn, xs)
        if prim is jp.convert_element_type_p and _widens(jnp.result_type(xs[0]), outs[0].dtype):
            return [_Held(outs[0], xs[0])]
        return [_Held(o) for o in outs]

    return rule


def _evaluate(jaxpr: jcore.Jaxpr, consts: List[_Held], args: List[_Held], sole_readers: bool) -> List[_Held]:
    """``jaxpr`` through the rule; readers are counted within ``jaxpr`` (an output counts as one)."""
    uses = collections.Counter(v for e in jaxpr.eqns for v in e.invars if isinstance(v, jcore.Var))
    uses.update(v for v in jaxpr.outvars if isinstance(v, jcore.Var))
    rule = _rule(sole_readers)
    outs = eval_jaxpr(jaxpr, consts, args, lambda eqn, invals: rule(eqn, invals, uses), literal=_Held)
    if not sole_readers:
        return outs
    # an output read inside too leaves plain: its readers outside cannot see those inside
    return [o if isinstance(v, jcore.Var) and uses[v] == 1 else _Held(o.x) for o, v in zip(outs, jaxpr.outvars)]


def evaluate_held(closed: jcore.ClosedJaxpr, args: Sequence[Any], *, sole_readers: bool) -> List[Any]:
    """The values of ``closed`` on ``args``, each ``scaled_dot_p`` given the narrow form of an
    operand that is its role's format widened (with ``sole_readers``: only where it alone reads it).

    Args:
      closed: a closed jaxpr. args: its arguments.
      sole_readers: True where the result may be differentiated later.

    Returns:
      The output values, as ``eval_jaxpr`` with ``bind`` gives them.
    """
    outs = _evaluate(closed.jaxpr, [_Held(c) for c in closed.consts], [_Held(a) for a in args], sole_readers)
    return [o.x for o in outs]


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
      >>> from jaxamp._src.placement.tensor_scale import scaled_dot
      >>> f = lambda c, w: scaled_dot(c.astype(jnp.float32), w, (((1,), (0,)), ((), ())))
      >>> c, w = jnp.ones((2, 3), jnp.float16), jnp.ones((3, 2))
      >>> bool((held_operands(f)(c, w) == f(c, w)).all())
      True
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        closed, flat, out_tree = trace(fun, args, kwargs)
        return jax.tree_util.tree_unflatten(out_tree, evaluate_held(closed, flat, sole_readers=False))

    return run
