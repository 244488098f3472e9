"""One jaxpr interpreter for every program rewrite in jaxamp.

jaxamp rewrites traced programs in three ways: Taylor propagation (:mod:`jaxamp.taylor`),
precision placement (:mod:`jaxamp.placement`) and scale/flag plumbing for scaled
``jaxamp.grad``. Each is :func:`eval_jaxpr` with its own per-equation *rule*, as
``jax.experimental.jet`` and checkify each pair one interpreter with a rule table.

A rule is ``rule(eqn, invals) -> outvals``: it receives the equation and whatever the
interpreter holds for each operand (plain arrays, or richer objects such as a primal with
its Taylor series), and returns one value per output variable. :func:`bind` evaluates an
equation as written, and :func:`sub_jaxpr` exposes the body of call-like equations so that
rules can recurse into ``jit``-ed functions.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from jax.extend import core as jcore

Rule = Callable[[Any, List[Any]], Sequence[Any]]

# Call-like primitives whose ``jaxpr`` parameter is the whole body, evaluated once.
CALL_PRIMITIVES = frozenset(("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"))
# Functions with a custom derivative rule: ``call_jaxpr`` is the primal body.
CUSTOM_PRIMITIVES = frozenset(("custom_jvp_call", "custom_vjp_call"))


def eval_jaxpr(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], rule: Rule, *,
               literal: Callable[[Any], Any] = lambda x: x) -> List[Any]:
    """Evaluate ``jaxpr`` on ``args`` equation by equation through ``rule``.

    Args:
      jaxpr: an open jaxpr (``closed.jaxpr`` of a ``ClosedJaxpr``).
      consts: values for ``jaxpr.constvars`` (already in the rule's value representation).
      args: values for ``jaxpr.invars`` (idem).
      rule: ``rule(eqn, invals) -> outvals``, one value per ``eqn.outvars``.
      literal: maps a literal's constant into the rule's value representation.

    Returns:
      The values of ``jaxpr.outvars``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxamp.interpreter import bind, eval_jaxpr
      >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)
      >>> [y] = eval_jaxpr(closed.jaxpr, closed.consts, [jnp.float32(1.0)], bind)  # as written: sin(1) * 2
      >>> round(float(y), 4)
      1.6829
    """
    if len(consts) != len(jaxpr.constvars) or len(args) != len(jaxpr.invars):
        raise ValueError(
            f"eval_jaxpr: got {len(consts)} consts and {len(args)} args for a jaxpr with "
            f"{len(jaxpr.constvars)} constvars and {len(jaxpr.invars)} invars."
        )
    env = {}

    def read(v):
        return literal(v.val) if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        outs = rule(eqn, [read(v) for v in eqn.invars])
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = out
    return [read(v) for v in jaxpr.outvars]


def bind(eqn, vals: Sequence[Any]) -> List[Any]:
    """Evaluate one equation on ``vals`` as the program wrote it; always a list of outputs."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def sub_jaxpr(eqn) -> Optional[jcore.ClosedJaxpr]:
    """The body of a call-like equation (``jit``, ``closed_call``, ``remat``), else None."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    body = eqn.params.get("jaxpr")
    if isinstance(body, jcore.ClosedJaxpr):
        return body
    if isinstance(body, jcore.Jaxpr):
        return jcore.ClosedJaxpr(body, ())
    return None


def custom_body(eqn) -> Optional[jcore.ClosedJaxpr]:
    """The primal body of a ``custom_jvp``/``custom_vjp`` call (its rule is not kept), else None."""
    if eqn.primitive.name not in CUSTOM_PRIMITIVES:
        return None
    body = eqn.params["call_jaxpr"]
    return body if isinstance(body, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(body, ())


def sub_jaxprs(eqn) -> List[jcore.Jaxpr]:
    """Every jaxpr in ``eqn``'s parameters (bodies of calls, loops, branches), open."""
    return [j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j for j in jcore.jaxprs_in_params(eqn.params)]
