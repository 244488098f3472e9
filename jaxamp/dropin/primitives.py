"""The two primitives that mark a scaled derivative in a traced program.

``deriv_scale_p`` stands for the scale of one derivative and ``deriv_check_p`` for the
overflow check of its scaled result. Outside :func:`jaxamp.dropin.scaled` they are inert
(the scale is 1.0, the check is the identity), so :func:`jaxamp.dropin.grad` is then
``jax.grad`` and XLA removes the multiplications by one. :func:`jaxamp.dropin.scaled`
interprets the traced program and gives them meaning: the current scale of the key, and
the ``found_inf`` flag of the key.

Both carry the static parameters ``order`` (the derivative order the step produces,
1 for a first derivative) and ``term`` (the name of the differentiated variable, ``"u"``
or ``"u__x"``, or None when unnamed); the scaler key follows from them and the amp config
(per-order: ``str(order)``; per-term and special terms: ``term``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

__all__ = ["deriv_scale_p", "deriv_check_p", "deriv_scale", "deriv_check", "PRIMITIVES"]

# ---------------------------------------------------------------- deriv_scale_p
# deriv_scale_p(v) -> f32 array of v's shape, every entry the scale of the key. Taking the
# differentiated value as operand makes the scale batched wherever the value is: under vmap
# every point gets its own copy of the seed, as the Derivatives engine does (one seed per
# point, so the weight gradient's batch sum happens after the seed's factor is applied).
deriv_scale_p = jcore.Primitive("jaxamp_deriv_scale")


def _scale_impl(v, *, order, term):
    del order, term
    return jnp.ones(jnp.shape(v), jnp.float32)


def _scale_abstract(v, *, order, term):
    del order, term
    return jax.core.ShapedArray(v.shape, jnp.float32)


def _scale_jvp(primals, tangents, *, order, term):
    (v,) = primals
    out = deriv_scale_p.bind(v, order=order, term=term)
    return out, ad.Zero(jax.core.ShapedArray(jnp.shape(out), jnp.float32))


def _scale_batch(args, dims, *, order, term):
    (v,), (d,) = args, dims
    return deriv_scale_p.bind(v, order=order, term=term), d


deriv_scale_p.def_impl(_scale_impl)
deriv_scale_p.def_abstract_eval(_scale_abstract)
ad.primitive_jvps[deriv_scale_p] = _scale_jvp
batching.primitive_batchers[deriv_scale_p] = _scale_batch
mlir.register_lowering(deriv_scale_p, mlir.lower_fun(_scale_impl, multiple_results=False))

# ---------------------------------------------------------------- deriv_check_p
# deriv_check_p(g, v) -> g: the identity on the scaled gradient g. v is the value that g
# differentiates (one scalar per point): a key overflows where v is finite and g is not;
# where v is not finite the point holds bad values (found_inf["nonfinite_values"]).
# Invariant kept by the batching rule: v.shape == g.shape[:v.ndim] (batch dims lead).
deriv_check_p = jcore.Primitive("jaxamp_deriv_check")


def _check_impl(g, v, *, order, term):
    del v, order, term
    return g


def _check_abstract(g, v, *, order, term):
    del v, order, term
    return jax.core.ShapedArray(g.shape, g.dtype)


def _check_jvp(primals, tangents, *, order, term):
    # The primal is checked; the tangent passes through unchecked (a derivative of this
    # derivative is checked by its own deriv_check_p), so no transpose rule is needed.
    g, v = primals
    g_dot, _ = tangents
    out = deriv_check_p.bind(g, v, order=order, term=term)
    if type(g_dot) is ad.Zero:
        return out, ad.Zero(jax.core.ShapedArray(g.shape, g_dot.aval.dtype))
    return out, g_dot


def _check_batch(args, dims, *, order, term):
    g, v = args
    dg, dv = dims
    size = g.shape[dg] if dg is not None else v.shape[dv]  # None: not batched
    g = batching.bdim_at_front(g, dg, size)
    v = batching.bdim_at_front(v, dv, size)
    return deriv_check_p.bind(g, v, order=order, term=term), 0


deriv_check_p.def_impl(_check_impl)
deriv_check_p.def_abstract_eval(_check_abstract)
ad.primitive_jvps[deriv_check_p] = _check_jvp
batching.primitive_batchers[deriv_check_p] = _check_batch
mlir.register_lowering(deriv_check_p, mlir.lower_fun(_check_impl, multiple_results=False))

PRIMITIVES = frozenset((deriv_scale_p, deriv_check_p))


def deriv_scale(v: jax.Array, *, order: int, term: Optional[str]) -> jax.Array:
    """The scale of the derivative of ``v`` (f32, ``v``'s shape); 1.0 outside ``scaled``."""
    return deriv_scale_p.bind(v, order=order, term=term)


def deriv_check(g: jax.Array, v: jax.Array, *, order: int, term: Optional[str]) -> jax.Array:
    """``g``, the scaled derivative of ``v``, marked for the overflow check of its key."""
    return deriv_check_p.bind(g, v, order=order, term=term)
