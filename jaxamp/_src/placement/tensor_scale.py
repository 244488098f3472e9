"""Per-tensor scaling: each low-precision matmul operand carries its own power-of-two scale.

``scaled_dot(a, b, dimension_numbers, formats)`` is ``lax.dot_general`` whose operands are each
multiplied by the scale :func:`scale_for` chooses from that operand's own magnitude, cast to
their role's format (float16, or FP8: :data:`FP8_FORMATS`), multiplied with float32
accumulation, and unscaled in float32. It is one primitive, ``scaled_dot_p``, bilinear like
``dot_general``: its JVP multiplies the tangents as
``scaled_dot`` again (``role="tangent"``) and its transpose the cotangents
(``role="cotangent"``), so derivative tangents and cotangents get scales from their own
magnitudes, not from the values'.

A scale is a power of two, so while an operand stays in its format's normal range the product is
the unscaled one bit for bit (binary scaling commutes with rounding); what changes is that a
tangent of 1e-7 or a value of 1e6 is brought into the window instead of flushing to zero or
overflowing. In an outer product (a contraction of length 1) each entry takes its own exponent
from its own magnitude, no amax. An operand already held in its format keeps scale 1 (its
products are exact in the float32 accumulator: a scale could only push small entries below the
normal range), so a float16 layer's float16 activations cost no amax. A zero or non-finite
operand keeps scale 1: an inf or NaN stays visible to the derivative scalers' checks. Under
``vmap`` the batched operand has one scale. ``jaxamp.autocast`` uses it for its matmuls with
``AmpConfig(tensor_scaling=True)`` (float16) and ``AmpConfig(dtype="float8")``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from jaxamp._src.core.rules import RULES, PrimitiveRules
from jaxamp._src.scaling.config_values import FP8_FORMATS, ROLES

__all__ = ["ROLES", "FP8_FORMATS", "MARGIN_LOG2", "scale_for", "scaled_dot", "scaled_dot_p"]

# Powers of two kept free below the format's largest power of two: the scaled operand's largest
# entry lands in [2**(emax - MARGIN_LOG2 - 1), 2**(emax - MARGIN_LOG2)].
MARGIN_LOG2 = 1

scaled_dot_p = jcore.Primitive("jaxamp_scaled_dot")


def scale_for(x: jax.Array, dtype: Any) -> jax.Array:
    """The power-of-two scale (float32 scalar) that puts ``max|x|`` just under ``dtype``'s
    largest power of two, ``MARGIN_LOG2`` below it; 1 for an all-zero or non-finite ``x``.

    Example:
      >>> import jax.numpy as jnp
      >>> float(scale_for(jnp.array([3e-6, -1e-6]), jnp.float16)) == 2.0**32  # 3e-6 * 2**32 is about 2**13.6
      True
    """
    return _pow2(_exponent(x, dtype))


def _exponent(x: jax.Array, dtype: Any) -> jax.Array:
    """``log2`` of :func:`scale_for` (int32 scalar, in [-126, 126])."""
    return _exponent_of(_amax(x) if jnp.size(x) else jnp.float32(0.0), dtype)


def _exponent_of(amax: jax.Array, dtype: Any) -> jax.Array:
    """The scale exponent for magnitudes ``amax`` (float32, >= 0; elementwise)."""
    emax = int(np.floor(np.log2(float(jnp.finfo(dtype).max))))
    # ceil(log2 amax) exactly, from amax's bits (>= 0): its exponent, plus 1 unless a power of two
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    ceil_log2 = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    e = jnp.clip(emax - MARGIN_LOG2 - ceil_log2, -126, 126)
    ok = (bits > 0) & (bits < 0x7F800000)  # neither zero nor inf nor NaN
    return jnp.where(ok, e, 0)


def _pow2(e: jax.Array) -> jax.Array:
    """``2.0**e`` (float32, exactly) for an int32 ``e`` in [-126, 127], from the bits: no
    division or transcendental, so XLA may fuse it into every consumer."""
    return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _amax(x: jax.Array) -> jax.Array:
    """``max|x|`` as float32, exactly. A 16-bit float's magnitudes order as its bit patterns with
    the sign bit cleared (NaN's above inf's above every finite one), and an integer max is the
    cheaper reduction on CPU; other dtypes take ``max(abs(x))``."""
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.bitcast_convert_type(x, jnp.int16) & jnp.int16(0x7FFF)
        return lax.bitcast_convert_type(jnp.max(bits), x.dtype).astype(jnp.float32)
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _exponent_or_none(x: jax.Array, dtype: Any, scaling: bool) -> Optional[jax.Array]:
    """The operand's scale exponent (:func:`_exponent`), or None, scale 1 known when tracing, when
    scaling is off or ``x`` is already held in ``dtype`` (every product of two such operands is
    exact in the float32 accumulator, so a scale could only lose bits, pushing small entries
    below the normal range)."""
    return _exponent(x, dtype) if scaling and jnp.dtype(x.dtype) != dtype else None


def _outer(a, dimension_numbers) -> bool:
    """The product contracts nothing but unit axes: an outer product, one term per output entry."""
    return all(a.shape[i] == 1 for i in dimension_numbers[0][0])


def _held(a, b, *, formats, scaling, role, dimension_numbers, **_):
    """``(format, [(exponent or None, operand * 2**exponent)])``: the operands as their role's
    format holds them. In an outer product each entry has its own exponent (an array): there is
    no sum for one scale to serve, so each entry is rounded as a per-tensor scale would round it
    while in range, with float32's range, and no amax (a reduction) runs."""
    dtype = jnp.dtype(formats[ROLES.index(role)])
    each = scaling and _outer(a, dimension_numbers)
    exps = [_exponent_of(jnp.abs(x).astype(jnp.float32), dtype) if each and jnp.dtype(x.dtype) != dtype
            else _exponent_or_none(x, dtype, scaling) for x in (a, b)]
    return dtype, [(e, x if e is None else x.astype(jnp.float32) * _pow2(e)) for e, x in zip(exps, (a, b))]


def _impl(a, b, *, dimension_numbers, formats, scaling, role, out_dtype):
    dtype, ((ea, a), (eb, b)) = _held(a, b, formats=formats, scaling=scaling, role=role,
                                      dimension_numbers=dimension_numbers)
    if any(jnp.ndim(e) for e in (ea, eb) if e is not None):  # an outer product: entries unscaled in float32
        a, b = [x.astype(dtype).astype(jnp.float32) * (1 if e is None else _pow2(-e)) for e, x in ((ea, a), (eb, b))]
        out = lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)  # each term exact
        return out.astype(out_dtype)
    out = lax.dot_general(a.astype(dtype), b.astype(dtype), dimension_numbers, preferred_element_type=jnp.float32)
    exps = [e for e in (ea, eb) if e is not None]
    if len(exps) == 1:  # one scaled operand: 2**-e is a normal float32 (|e| <= 126)
        out = out * _pow2(-exps[0])
    elif exps:  # 2**-(ea + eb) may leave float32's exponent range: two exact halves, the partial
        e = exps[0] + exps[1]  # product between ``out`` and the result (it rounds only where they do)
        half = e // 2
        out = out * _pow2(-half) * _pow2(half - e)
    return out.astype(out_dtype)


def _profiled(a, b, **params):
    """What :func:`jaxamp.profile` reports of one product (``Profile.operands``)."""
    dtype, held = _held(a, b, **params)
    return [(params["role"], dtype.name, x) for _, x in held]


def scaled_dot(a: jax.Array, b: jax.Array, dimension_numbers, formats: Sequence[Any] = ("float16",) * 3,
               role: str = "value", *, scaling: bool = True, out_dtype: Any = jnp.float32) -> jax.Array:
    """``lax.dot_general(a, b, dimension_numbers)`` on low-precision operands with per-tensor
    scales, accumulated and unscaled in float32, ``out_dtype`` out.

    Args:
      a, b, dimension_numbers: as ``lax.dot_general``.
      formats: the operands' format per role (value, tangent, cotangent): float16 or FP8.
      role: ``"value"``, ``"tangent"`` or ``"cotangent"`` (what ``a`` and ``b`` are).
      scaling: False: plain casts to the formats (scale 1), the baseline.
      out_dtype: the product's dtype (float32, or the compute dtype of a layer whose next
        operations run in it: its cotangents then arrive in that dtype too).

    Returns:
      The product, unscaled, in ``out_dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> a, b = jnp.full((2, 3), 1e-6), jnp.ones((3, 2))
      >>> dims = (((1,), (0,)), ((), ()))
      >>> round(float(scaled_dot(a, b, dims)[0, 0]) / 3e-6, 3)  # float16 holds 1e-6 only as a subnormal
      1.0
    """
    if role not in ROLES:
        raise ValueError(f"scaled_dot: `role`={role!r} is not allowed: expected one of {ROLES}.")
    if not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
        raise ValueError(f"scaled_dot: `out_dtype`={out_dtype!r} is not allowed: expected a "
                         "floating dtype (float32, float16, bfloat16); the product is not rounded to integers.")
    names = tuple(jnp.dtype(f).name for f in formats)
    return scaled_dot_p.bind(a, b, dimension_numbers=_dims(dimension_numbers), formats=names, scaling=bool(scaling),
                             role=role, out_dtype=jnp.dtype(out_dtype).name)


def _dims(dimension_numbers) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def _abstract(a, b, *, dimension_numbers, formats, scaling, role, out_dtype):
    out = jax.eval_shape(lambda x, y: lax.dot_general(x, y, dimension_numbers, preferred_element_type=jnp.float32),
                         jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype))
    return jax.core.ShapedArray(out.shape, jnp.dtype(out_dtype))


def _jvp(primals, tangents, *, dimension_numbers, formats, scaling, role, out_dtype):
    a, b = primals
    ta, tb = tangents
    params = dict(dimension_numbers=dimension_numbers, formats=formats, scaling=scaling, out_dtype=out_dtype)
    out = scaled_dot_p.bind(a, b, role=role, **params)
    parts = []
    if not isinstance(ta, ad.Zero):
        parts.append(scaled_dot_p.bind(ta, b, role="tangent", **params))
    if not isinstance(tb, ad.Zero):
        parts.append(scaled_dot_p.bind(a, tb, role="tangent", **params))
    tangent = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return out, tangent


def _remaining(n: int, *removed: Sequence[int]) -> list:
    drop = {i for r in removed for i in r}
    return [i for i in range(n) if i not in drop]


def _transpose_lhs(g, x_aval, y, dimension_numbers, params, swap: bool = False):
    """The cotangent of the left operand (as ``lax``'s dot_general transpose), as a scaled_dot."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(len(x_aval.shape), x_contract, x_batch)
    y_kept = _remaining(np.ndim(y), y_contract, y_batch)
    nb = len(x_batch)
    ans_batch = list(range(nb))
    if swap:
        ans_y = list(range(nb, nb + len(y_kept)))
    else:
        ans_y = list(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_sorted_by_y)
    out = scaled_dot_p.bind(g, y, dimension_numbers=dims, role="cotangent", out_dtype=x_aval.dtype.name, **params)
    return lax.transpose(out, tuple(int(i) for i in out_axes))


def _transpose(g, a, b, *, dimension_numbers, formats, scaling, role, out_dtype):
    if isinstance(g, ad.Zero):
        return [None, None]
    (lc, rc), (lb, rb) = dimension_numbers
    ct_a = ct_b = None
    params = dict(formats=formats, scaling=scaling)
    if ad.is_undefined_primal(a):
        ct_a = _transpose_lhs(g, a.aval, b, dimension_numbers, params)
    if ad.is_undefined_primal(b):
        ct_b = _transpose_lhs(g, b.aval, a, ((rc, lc), (rb, lb)), params, swap=True)
    return [ct_a, ct_b]


def _batch(args, dims, *, dimension_numbers, **params):
    """The batch axis as a dot_general batch (both batched) or free (one batched) dimension: the
    scale is then that of the whole batched operand, and the equation stays ``scaled_dot_p``,
    so derivatives taken after ``vmap`` still scale their tangents and cotangents."""
    (a, b), (da, db) = args, dims
    a = a if da is None else jnp.moveaxis(a, da, 0)
    b = b if db is None else jnp.moveaxis(b, db, 0)
    (lc, rc), (lb, rb) = dimension_numbers
    up = lambda axes, on: tuple(i + 1 for i in axes) if on else tuple(axes)  # noqa: E731
    lc, lb, rc, rb = up(lc, da is not None), up(lb, da is not None), up(rc, db is not None), up(rb, db is not None)
    if da is not None and db is not None:
        dims_out, out_dim = ((lc, rc), ((0,) + lb, (0,) + rb)), 0
    elif da is not None:  # lhs axis 0 is its first free dimension: right after the batch dims
        dims_out, out_dim = ((lc, rc), (lb, rb)), len(lb)
    else:  # rhs axis 0: after the batch dims and the lhs free dims
        dims_out, out_dim = ((lc, rc), (lb, rb)), len(lb) + a.ndim - len(lc) - len(lb)
    return scaled_dot_p.bind(a, b, dimension_numbers=dims_out, **params), out_dim


scaled_dot_p.def_impl(_impl)
scaled_dot_p.def_abstract_eval(_abstract)
ad.primitive_jvps[scaled_dot_p] = _jvp
ad.primitive_transposes[scaled_dot_p] = _transpose
batching.primitive_batchers[scaled_dot_p] = _batch
mlir.register_lowering(scaled_dot_p, mlir.lower_fun(_impl, multiple_results=False))
# what a profile reports of its operands; bilinear, as dot_general, for Taylor mode
RULES[scaled_dot_p] = PrimitiveRules(held_operands=_profiled, taylor="bilinear")
