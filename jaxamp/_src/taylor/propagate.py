"""Taylor propagation on :func:`jaxamp._src.core.interpreter.eval_jaxpr`: every variable ``z`` holds a
:class:`Jet`, its value and ``z_j = d^j z(x + tau e) / d tau^j`` at ``tau = 0`` (times ``S_j``). An
``x``-dependent equation is entered if call-like, else handed to a :data:`Rule` as an :class:`Application`.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxamp._src.core import interpreter
from jaxamp._src.taylor import rules

__all__ = ["Coefficients", "Jet", "Application", "Rule", "propagate", "restrict", "inexact", "multilinear"]

# Taylor coefficients of orders 1..K of one variable; None for an order that is identically 0.
Coefficients = Tuple[Optional[jax.Array], ...]


class Jet(NamedTuple):
    """A variable's value and its Taylor coefficients (``None``: it does not depend on ``x``)."""

    value: Any
    coefficients: Optional[Coefficients] = None


class Application(NamedTuple):
    """One equation whose operands ``dependent`` depend on ``x``, as a rule receives it."""

    eqn: jcore.JaxprEqn
    values: Tuple[Any, ...]  # every operand's value
    dependent: Tuple[int, ...]  # positions of the x-dependent operands
    coefficients: Tuple[Coefficients, ...]  # their coefficients, in the order of ``dependent``
    degree: Optional[int]  # the primitive's degree in them (jaxamp._src.taylor.rules.degree)

    def restrict(self, which: Sequence[int]) -> Callable[..., List[jax.Array]]:
        """The primitive's outputs as a function of the dependent operands ``which`` (positions
        into ``dependent``), the others held."""
        return restrict(self.eqn, self.values, [self.dependent[w] for w in which])

    def primals(self, which: Sequence[int]) -> Tuple[Any, ...]:
        """The values of the dependent operands ``which`` (positions into ``dependent``)."""
        return tuple(self.values[self.dependent[w]] for w in which)


# rule(application) -> (outputs, one Coefficients or None per output)
Rule = Callable[[Application], Tuple[List[jax.Array], List[Optional[Coefficients]]]]


def propagate(f: Callable[[jax.Array], jax.Array], x: jax.Array, seed: Coefficients,
              rule: Rule) -> Tuple[jax.Array, List[jax.Array]]:
    """``f(x)`` and its Taylor coefficients, from ``x``'s coefficients ``seed`` and ``rule``.

    ``seed`` holds ``x``'s coefficients of orders ``1..K`` (``None`` for a zero order); the
    returned ones are zeros where identically 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp._src.taylor.faa_di_bruno import series_rule
      >>> from jaxamp._src.taylor.propagate import propagate
      >>> y, (d1, d2) = propagate(jnp.sin, jnp.float32(0.5), (jnp.float32(1.0), None), series_rule(None, 2))
      >>> bool(jnp.allclose(d2, -jnp.sin(0.5)))  # the order-2 seed is 0: d2 = sin''(0.5)
      True
    """
    closed = jax.make_jaxpr(f)(x)

    def run(body: jcore.ClosedJaxpr, args: Sequence[Jet]) -> List[Jet]:
        return interpreter.eval_jaxpr(body.jaxpr, [Jet(c) for c in body.consts], args, step, literal=Jet)

    def step(eqn: jcore.JaxprEqn, invals: List[Jet]) -> List[Jet]:
        values = tuple(v.value for v in invals)
        dependent = tuple(i for i, v in enumerate(invals) if v.coefficients is not None)
        if not dependent or rules.degree(eqn.primitive, len(dependent)) == 0:
            return [Jet(out) for out in interpreter.bind(eqn, values)]
        body = rules.body(eqn)
        if body is not None:
            return run(body, invals)
        app = Application(eqn, values, dependent, tuple(invals[i].coefficients for i in dependent),
                          rules.degree(eqn.primitive, len(dependent)))
        outs, coefficients = rule(app)
        return [Jet(out, c if inexact(v.aval.dtype) else None) for v, out, c in zip(eqn.outvars, outs, coefficients)]

    (out,) = run(closed, [Jet(x, tuple(seed))])
    coefficients = out.coefficients or (None,) * len(seed)
    return out.value, [jnp.zeros_like(out.value) if c is None else c for c in coefficients]


def restrict(eqn: jcore.JaxprEqn, values: Sequence[Any], slots: Sequence[int]) -> Callable[..., List[jax.Array]]:
    """The outputs of ``eqn`` as a function of its operands at ``slots``, the others held at ``values``."""
    return lambda *operands: interpreter.bind(eqn, interpreter.substitute(values, slots, operands))


def inexact(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating or complex type (only those carry coefficients)."""
    return jnp.issubdtype(dtype, jnp.inexact)


def multilinear(fn: Callable[..., List[jax.Array]], primals: Tuple[jax.Array, ...],
                tangents: Sequence[Tuple[jax.Array, ...]]) -> List[jax.Array]:
    """``fn^(m)[t_1, ..., t_m]`` at ``primals`` by ``m`` nested ``jax.jvp`` (``t_1`` innermost);
    each tangent is a tuple with one entry per operand.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp._src.taylor.propagate import multilinear
      >>> multilinear(lambda a: [a**3], (jnp.float32(2.0),), [(jnp.float32(1.0),)] * 2)
      [Array(12., dtype=float32)]
    """
    g = fn
    for t in tangents[:-1]:
        g = (lambda inner, t: lambda *p: jax.jvp(inner, p, t)[1])(g, t)
    return jax.jvp(g, primals, tuple(tangents[-1]))[1]
