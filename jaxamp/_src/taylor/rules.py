"""What the Taylor interpreter knows about primitives, in one table.

A primitive's *degree* in its ``x``-dependent operands is the highest order of its derivatives in
them that is not identically zero; it bounds the nonzero terms of Faa di Bruno's formula
(:mod:`jaxamp._src.taylor.faa_di_bruno`): 1 (linear) has no product terms, 2 keeps products of two
coefficients, ``None`` keeps every term. Call-like primitives are entered (:func:`body`).
JAX's primitives are listed here, as objects; jaxamp's own give their degree in the rule table
(the ``taylor`` field of :data:`jaxamp._src.core.rules.RULES`).
"""

from __future__ import annotations

from typing import Optional

from jax import lax
from jax._src import ad_util  # add_any (add_jaxvals_p): not exported by jax.extend (JAX 0.10)
from jax.extend import core as jcore

from jaxamp._src.core import interpreter
from jaxamp._src.core.rules import rules_of

__all__ = ["LINEAR", "BILINEAR", "degree", "body"]

# Linear in their x-dependent operands (the others held fixed); JAX's primitive objects.
LINEAR = frozenset((
    lax.add_p, ad_util.add_jaxvals_p, lax.sub_p, lax.neg_p, lax.convert_element_type_p, lax.reshape_p,
    lax.broadcast_in_dim_p, lax.squeeze_p, lax.transpose_p, lax.slice_p, lax.concatenate_p, lax.reduce_sum_p,
    lax.copy_p, lax.real_p, lax.imag_p, lax.conj_p, lax.pad_p, lax.rev_p, lax.select_n_p, lax.dynamic_slice_p,
    lax.dynamic_update_slice_p, lax.gather_p, lax.stack_p, lax.unstack_p, lax.split_p, lax.cumsum_p, lax.scatter_add_p,
))
# Linear in each operand: linear when one operand depends on x, degree 2 when two do.
BILINEAR = frozenset((lax.mul_p, lax.dot_general_p))


def degree(primitive: jcore.Primitive, n_dependent: int) -> Optional[int]:
    """The degree of ``primitive`` in its ``n_dependent >= 1`` x-dependent operands, or
    ``None`` when no derivative order is known to vanish. A scaler key's scale (jaxamp's
    ``deriv_scale_p``) takes its operand for its shape only: degree 0, no coefficients.

    Example:
      >>> from jax import lax
      >>> from jaxamp._src.core.marks import deriv_scale_p
      >>> from jaxamp._src.taylor.rules import degree
      >>> degree(lax.mul_p, 1), degree(lax.mul_p, 2), degree(lax.tanh_p, 1), degree(deriv_scale_p, 1)
      (1, 2, None, 0)
    """
    kind = rules_of(primitive).taylor
    if kind is None:
        kind = "linear" if primitive in LINEAR else "bilinear" if primitive in BILINEAR else None
    if kind == "constant":
        return 0
    if kind == "linear" or (kind == "bilinear" and n_dependent == 1):
        return 1
    return 2 if kind == "bilinear" else None


def body(eqn: jcore.JaxprEqn) -> Optional[jcore.ClosedJaxpr]:
    """The body evaluated in place of a call-like equation (e.g. a ``jit``-ed function such as
    flax's activations: the ``call`` of :data:`jaxamp._src.core.rules.RULES`), else None.
    Rematerialised bodies (``jax.checkpoint``) are differentiated whole, so that their
    rematerialisation policy still applies to the weight gradient taken through the Taylor
    coefficients.

    Example:
      >>> import jax
      >>> from jaxamp._src.taylor.rules import body
      >>> eqn = jax.make_jaxpr(jax.jit(lambda x: x + 1))(1.0).jaxpr.eqns[0]
      >>> body(eqn) is not None
      True
    """
    return interpreter.sub_jaxpr(eqn)
