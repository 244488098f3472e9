"""What the Taylor interpreter knows about primitives, in one table.

A primitive's *degree* in the operands that depend on the differentiation variable is the
highest order of its derivatives in them that is not identically zero. It bounds the terms
of Faa di Bruno's formula (:mod:`jaxamp.taylor.faa_di_bruno`) that can be nonzero: degree 1
(linear) maps every Taylor coefficient on its own, with no product terms; degree 2 keeps the
products of two coefficients; unbounded (``None``) keeps every term. Call-like primitives are
not differentiated as one: the interpreter evaluates their body (:func:`body`).
"""

from __future__ import annotations

from typing import Optional

from jax.extend import core as jcore

from jaxamp import interpreter

# Linear in their x-dependent operands (the others held fixed).
LINEAR = frozenset(
    "add add_any sub neg convert_element_type reshape broadcast_in_dim squeeze expand_dims transpose "
    "slice concatenate reduce_sum copy real imag conj pad rev select_n dynamic_slice "
    "dynamic_update_slice gather".split()
)
# Linear in each operand: linear when one operand depends on x, degree 2 when two do.
BILINEAR = frozenset(("mul", "dot_general"))
# Call-like primitives whose body is interpreted equation by equation. Rematerialised bodies
# (remat/checkpoint) are differentiated whole, so that their rematerialisation policy still
# applies to the weight gradient taken through the Taylor coefficients.
INLINED_CALLS = interpreter.CALL_PRIMITIVES - {"remat", "checkpoint"}


def degree(name: str, n_dependent: int) -> Optional[int]:
    """The degree of primitive ``name`` in its ``n_dependent`` x-dependent operands.

    Args:
      name: the primitive's name (``eqn.primitive.name``).
      n_dependent: how many of its operands depend on the differentiation variable (>= 1).

    Returns:
      1 for a linear primitive (or a bilinear one with one dependent operand), 2 for a
      bilinear one with two, ``None`` when no derivative order is known to vanish.

    Example:
      >>> from jaxamp.taylor.rules import degree
      >>> degree("mul", 1), degree("mul", 2), degree("tanh", 1)
      (1, 2, None)
    """
    if name in LINEAR or (name in BILINEAR and n_dependent == 1):
        return 1
    if name in BILINEAR:
        return 2
    return None


def body(eqn: jcore.JaxprEqn) -> Optional[jcore.ClosedJaxpr]:
    """The body the interpreter evaluates in place of a call-like equation, else None.

    Args:
      eqn: one equation of a jaxpr.

    Returns:
      The call's body for the primitives in :data:`INLINED_CALLS` (``jit``-ed functions such as
      flax's activations), ``None`` for every other equation.

    Example:
      >>> import jax
      >>> from jaxamp.taylor.rules import body
      >>> eqn = jax.make_jaxpr(jax.jit(lambda x: x + 1))(1.0).jaxpr.eqns[0]
      >>> body(eqn) is not None
      True
    """
    if eqn.primitive.name not in INLINED_CALLS:
        return None
    return interpreter.sub_jaxpr(eqn)
