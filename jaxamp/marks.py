"""The one home of a scaled derivative step: its marks, its key rule, its check and its unscale.

A scaled derivative step (docs/algorithm.md, "One derivative step") is written with two
primitives that every jaxamp path emits, the drop-in derivatives and the Derivatives engine
alike:

- ``deriv_scale_p(v)`` stands for the scale of the derivative of ``v`` (the seed's factor);
- ``deriv_check_p(g, v)`` marks ``g``, the scaled derivative of ``v``, for the overflow check.

Both carry the static parameters ``order`` (the order the step produces, 1 for a first
derivative) and ``term`` (the name of the differentiated value, ``"u"`` or ``"u__x"``, or
None). Outside :func:`jaxamp.scaled` they are inert (scale 1, the check the identity), so a
marked program is plain JAX; :func:`jaxamp.scaled` interprets them. This module also owns
the rules every path shares: the scaler key of a step (:func:`scaler_key`), the name
separator (:data:`SEP`), the flag of a step (:func:`step_flags`: overflow vs bad values),
the seed's factor and the unscale in float32 (:func:`seed`, :func:`unscale`) and the flag
merge (:func:`merge_found_inf`).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, MutableMapping, Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

__all__ = ["SEP", "NONFINITE_VALUES", "scaler_key", "step_flags", "seed", "unscale", "or_into", "merge_found_inf",
           "deriv_scale_p", "deriv_check_p", "deriv_scale", "deriv_check", "PRIMITIVES"]

SEP = "__"  # "u__x" is du/dx, "u__x__y" is d/dy(du/dx)
# Reserved key of found_inf: True when an input, a network output or a value below a
# derivative is non-finite (bad values: no scale can cure them).
NONFINITE_VALUES = "nonfinite_values"


def scaler_key(amp, order: int, term: Optional[str]) -> str:
    """The scaler key of a step of ``order`` that differentiates the value named ``term``.

    docs/algorithm.md, "Scaler keys": per order, ``str(order)``; per term (``amp.mode ==
    "per_term_scaler"``) or for a special term, the name of the differentiated value. Order
    0 marks a value check (a network output checked for bad values): :data:`NONFINITE_VALUES`.

    Args:
      amp: an :class:`~jaxamp.AmpConfig`, or None (per-order keys).
      order: the derivative order the step produces (1 for a first derivative).
      term: the name of the differentiated value, or None when it is unnamed.

    Returns:
      The key, a string.

    Example:
      >>> import jaxamp
      >>> scaler_key(jaxamp.AmpConfig(), 2, "u__x"), scaler_key(jaxamp.AmpConfig(special_terms=("nu",)), 1, "nu")
      ('2', 'nu')
    """
    if order == 0:  # a value check (bad values only): no scaler guards it
        return NONFINITE_VALUES
    if amp is not None and (amp.mode == "per_term_scaler" or term in amp.special_terms):
        if term is None:
            raise ValueError(
                f"jaxamp: a derivative of order {order} differentiates an unnamed value, but "
                f"amp.mode={amp.mode!r} keys scalers by name; name it with jaxamp.grad(fun, argnums, "
                "of='u', wrt='x'), or build the jaxamp.Derivatives engine with this amp."
            )
        return term
    return str(order)


def step_flags(g: jax.Array, below_ok: jax.Array) -> jax.Array:
    """Per point: the scaled result ``g`` of a step is non-finite while the values below it
    are finite (``below_ok``): a true overflow, which backing the key's scale off can cure.

    ``g``'s axes beyond ``below_ok``'s (a gradient's own axes) are reduced.
    """
    bad_g = ~jnp.isfinite(g)
    if bad_g.ndim > jnp.ndim(below_ok):
        bad_g = jnp.any(bad_g, axis=tuple(range(jnp.ndim(below_ok), bad_g.ndim)))
    return bad_g & below_ok


def seed(t: jax.Array, s: jax.Array, dtype: Optional[Any] = None) -> jax.Array:
    """``t * s`` computed in (at least) float32 (step 1 of a derivative step: the seed's factor);
    cast to ``dtype`` when given (a tangent in its primal's dtype), else in that wide dtype."""
    wide = jnp.promote_types(jnp.result_type(t) if dtype is None else dtype, jnp.float32)
    out = jnp.asarray(t, wide) * jnp.asarray(s).astype(wide)
    return out if dtype is None else out.astype(dtype)


def unscale(g: jax.Array, inv: jax.Array) -> jax.Array:
    """``g * inv`` in (at least) float32, back in ``g``'s dtype (step 4 of a derivative step);
    ``inv`` broadcasts over ``g``'s trailing axes (one factor per value: a Jacobian's rows)."""
    if not jnp.issubdtype(g.dtype, jnp.inexact):  # float0 gradients of integers (allow_int)
        return g
    wide = jnp.promote_types(g.dtype, jnp.float32)
    inv = jnp.reshape(inv, jnp.shape(inv) + (1,) * (g.ndim - jnp.ndim(inv)))
    return (g.astype(wide) * inv.astype(wide)).astype(g.dtype)


def or_into(flags: MutableMapping[str, jax.Array], key: str, hit) -> None:
    """``flags[key] |= hit`` (set when absent): the one way flags are merged."""
    flags[key] = hit if key not in flags else flags[key] | hit


def merge_found_inf(*flags: Mapping[str, jax.Array]) -> Dict[str, jax.Array]:
    """OR together several ``found_inf`` dicts (keys may overlap).

    Example:
      >>> import jax.numpy as jnp
      >>> merge_found_inf({"2": jnp.array(False)}, {"2": jnp.array(True), "1": jnp.array(False)})["2"]
      Array(True, dtype=bool)
    """
    out: Dict[str, jax.Array] = {}
    for f in flags:
        for k, v in f.items():
            or_into(out, k, v)
    return out


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
# where v is not finite the point holds bad values (found_inf["nonfinite_values"]). At
# order 0, g is a value the program holds (v = g): bad values are its only flag.
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
