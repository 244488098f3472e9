"""The one home of a scaled derivative step: its marks, its key rule, its check and its unscale.

Every jaxamp path writes a scaled step (docs/algorithm.md, "One derivative step") with
``deriv_scale_p(v)``, the scale of the derivative of ``v``, and ``deriv_check_p(g, v)``, which
marks ``g``, the scaled derivative of ``v``, for the overflow check; both carry a static
``order`` relative to ``v``'s (:mod:`jaxamp._src.core.nesting` reads the step's order from the program),
``term`` and ``wrt``. Outside :func:`jaxamp.scaled`, which interprets them, they are inert.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from jaxamp._src.core.rules import RULES, PrimitiveRules

__all__ = [
    "SEP", "NONFINITE_VALUES", "scaler_key", "step_flags", "seed", "rescale", "unscale", "or_into",
    "any_set", "merge_found_inf", "reduce_flags", "UNINTERPRETED", "UnscaledDerivativeWarning", "deriv_scale_p",
    "deriv_check_p", "deriv_scale", "deriv_check", "fresh", "PRIMITIVES", "flags_only"
]

SEP = "__"  # "u__x" is du/dx, "u__x__y" is d/dy(du/dx)
# Reserved key of found_inf: True when an input, a network output or a value below a
# derivative is non-finite (bad values: no scale can cure them).
NONFINITE_VALUES = "nonfinite_values"


def scaler_key(amp, order: int, term: Optional[str]) -> str:
    """The scaler key of a step of ``order`` that differentiates the value named ``term``.

    Args:
      amp: an :class:`~jaxamp.AmpConfig`, or None (per-order keys).
      order: the derivative order the step produces (1 for a first derivative; 0: a value check).
      term: the name of the differentiated value, or None when it is unnamed.

    Returns:
      ``str(order)``; per term or for a special term ``term``; at order 0 :data:`NONFINITE_VALUES`.

    Example:
      >>> import jaxamp
      >>> scaler_key(jaxamp.AmpConfig(), 2, "u__x"), scaler_key(jaxamp.AmpConfig(special_terms=("nu",)), 1, "nu")
      ('2', 'nu')
    """
    if order == 0:  # a value check (bad values only): no scaler guards it
        return NONFINITE_VALUES
    if amp is not None and (amp.mode == "per_term_scaler" or term in amp.special_terms):
        if term is None:
            raise ValueError(f"jaxamp: a derivative of order {order} differentiates an unnamed "
                             f"value, but amp.mode={amp.mode!r} keys scalers by name; name it with "
                             "jaxamp.grad(fun, argnums, of='u', wrt='x'), or build the "
                             "jaxamp.Derivatives engine with this amp.")
        return term
    return str(order)


def step_flags(g: jax.Array, below_ok: jax.Array) -> jax.Array:
    """Per point: the scaled result ``g`` of a step is non-finite while the values below it are
    finite (``below_ok``), a true overflow; ``g``'s axes beyond ``below_ok``'s are reduced."""
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


def rescale(t: jax.Array, factors: Sequence[Any]) -> jax.Array:
    """``t * factors[0] * factors[1] * ...`` in (at least) float32, float64 staying float64,
    rounded once back to ``t``'s dtype: the factors' product may leave float32's range where
    each partial product does not.

    Example:
      >>> import jax.numpy as jnp
      >>> rescale(jnp.ones(2, jnp.float16), (jnp.float32(2.0**20), jnp.float32(2.0**-16)))
      Array([16., 16.], dtype=float16)
    """
    wide = jnp.promote_types(t.dtype, jnp.float32)
    out = t.astype(wide)
    for r in factors:
        out = out * jnp.asarray(r).astype(wide)
    return out.astype(t.dtype)


def unscale(g: jax.Array, inv: jax.Array) -> jax.Array:
    """``g * inv`` by :func:`rescale` (step 4 of a derivative step); ``inv`` broadcasts over
    ``g``'s trailing axes (one factor per value: a Jacobian's rows)."""
    if not jnp.issubdtype(g.dtype, jnp.inexact):  # float0 gradients of integers (allow_int)
        return g
    return rescale(g, (jnp.reshape(inv, jnp.shape(inv) + (1,) * (g.ndim - jnp.ndim(inv))),))


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


def reduce_flags(pending: Mapping[str, List[jax.Array]]) -> Dict[str, jax.Array]:
    """``{key: bool[]}``, any of each key's per-point flags, in one GPU kernel per flag size.

    Each element of one size gets one integer code, bit ``i`` set where the ``i``-th key's flag is
    (each key's flags ORed in, fused with the checks that produce them); each key's flag is then an
    ``any`` of its bit over that code. The keys' reductions read one array, so XLA merges them into
    one kernel (stacking the keys' flags instead writes a copy of them all first), and each stays an
    OR of booleans, reduced across devices as ``jnp.any`` is when the points are sharded (a bitwise
    OR reduction has no cross-device form). Past :data:`ROW_BOUND` points the keys' first stage is
    one kernel and each key's second stage an OR of its pieces fused into the consumers
    (:func:`any_rows`; left to XLA, a kernel per key: H100 program, 4x128 / 20 000 points, −2).

    Example:
      >>> import jax.numpy as jnp
      >>> out = reduce_flags({"1": [jnp.array([False, True])], "2": [jnp.zeros(3, bool)]})
      >>> {k: bool(v) for k, v in out.items()}
      {'1': True, '2': False}
    """
    keys = list(pending)
    found: Dict[str, List[jax.Array]] = {}
    for start in range(0, len(keys), 32):  # up to 32 keys in one code
        group = keys[start:start + 32]
        dtype = jnp.uint8 if len(group) <= 8 else jnp.uint32
        codes: Dict[int, jax.Array] = {}  # size -> per-element code of the group's keys
        has: Dict[int, Dict[str, int]] = {}  # size -> {key with flags of that size: its bit}
        for bit, key in enumerate(group):
            for hit in pending[key]:
                h = jnp.left_shift(jnp.ravel(hit).astype(dtype), dtype(bit))
                n = int(jnp.size(hit))
                codes[n] = h if n not in codes else codes[n] | h
                has.setdefault(n, {})[key] = bit
        for n, code in codes.items():
            keyed = list(has[n].items())
            masks = jnp.asarray([1 << bit for _, bit in keyed], dtype)
            rows = any_rows(code, lambda c, i: jnp.bitwise_and(c, masks[i]) != 0, len(keyed))
            for (key, _), row in zip(keyed, rows):
                found.setdefault(key, []).append(row)
    return {key: f[0] if len(f) == 1 else any_set(f) for key, f in found.items()}


# XLA's GPU compiler reduces a row of up to this many elements in one kernel; a longer one in two,
# the second stage a kernel of its own per result (its tree reduction rewriter: 1 024 threads x 16)
ROW_BOUND = 16384


def _pieces(n: int) -> int:
    """How many pieces :func:`any_rows` cuts a row of ``n > ROW_BOUND`` elements into: about
    ``sqrt(n)`` (as XLA's own split: short rows keep the producer fused into the first stage; rows
    of 10 000 elements did not), a divisor of ``n`` with the most factors of 2 (a point axis sharded
    over a power-of-two number of devices then cuts into whole pieces per device), else a power of 2
    (``n`` padded)."""
    root = math.isqrt(n)
    low, high = max(2, -(-n // ROW_BOUND), root // 2), 2 * root
    divisors = [p for p in range(low, high + 1) if n % p == 0 and n // p <= ROW_BOUND]
    if divisors:
        return max(divisors, key=lambda p: ((p & -p), -abs(p - root)))
    return max(1 << (root.bit_length() - 1), -(-n // ROW_BOUND))


def any_rows(values: jax.Array, test: Any, count: int, pad: Any = 0) -> List[jax.Array]:
    """``[bool[]] * count``: ``any`` of each row of ``test(values)``, all rows in one reduction.

    ``values`` is a vector (``[n]``); ``test(x, i)`` maps an array of its elements to bools, elementwise,
    for row ``i``: an ``int``, or an index array of shape ``[count, 1, 1]`` (then each row on the leading
    axis, e.g. ``(x & masks[i]) != 0``: one bit of a code per row); ``False`` on ``pad``. Rows of at
    most :data:`ROW_BOUND` elements: a reduction per row, which XLA merges into one kernel (they read
    one array). A longer row: the first stage written out, ``values`` reduced in about ``sqrt(n)`` pieces
    (one kernel, ``bool[count, pieces]``; :func:`_pieces`), each row's result the OR of its pieces, a
    chain of ORs that XLA fuses into every consumer (left to XLA, the second stage is one more
    kernel per row: H100 program, 4x128 / 20 000 points, docs/gpu.md).

    Example:
      >>> import jax.numpy as jnp
      >>> code = jnp.zeros(40000, jnp.uint8).at[39999].set(2)
      >>> masks = jnp.array([1, 2], jnp.uint8)
      >>> [bool(r) for r in any_rows(code, lambda c, i: (c & masks[i]) != 0, 2)]
      [False, True]
    """
    n = values.shape[0]
    if n <= ROW_BOUND:  # a reduction per row: XLA merges those reading one array into one kernel
        return [jnp.any(test(values, i)) for i in range(count)]
    pieces = _pieces(n)
    if n % pieces:
        values = jnp.pad(values, (0, -n % pieces), constant_values=pad)
    x = values.reshape(1, pieces, -1)
    part = jnp.any(jnp.broadcast_to(test(x, jnp.arange(count).reshape(count, 1, 1)), (count,) + x.shape[1:]),
                   axis=-1)  # [count, pieces]
    return [functools.reduce(jnp.logical_or, [part[i, j] for j in range(pieces)]) for i in range(count)]


def any_set(flags: Sequence[Any]) -> jax.Array:
    """``bool[]``: any of ``flags`` (bools) is set, as one reduction that XLA keeps as one kernel.

    XLA rewrites a reduction over scalars stacked directly into a chain of ORs and fuses that
    chain into every consumer of the result (each select of a train step would recompute it); a
    conversion between the stack and the reduction keeps it one kernel, its result computed once.

    Example:
      >>> import jax.numpy as jnp
      >>> bool(any_set([jnp.array(False), jnp.array(True)])), bool(any_set([]))
      (True, False)
    """
    if not flags:
        return jnp.asarray(False)
    return jnp.any(jnp.stack([jnp.asarray(f, bool).reshape(()) for f in flags]).astype(jnp.uint8) != 0)


# ---------------------------------------------------------------- deriv_scale_p
# deriv_scale_p(v) -> f32 array of v's shape, every entry the key's scale; params order (relative
# to v's: jaxamp._src.core.nesting), term, wrt, scalar. With v as operand the scale is batched
# wherever v is: one seed per point under vmap, as the Derivatives engine. scalar=True: one f32[]
# scale, never batched (a key has one scale): seeds built from it stay unbatched under vmap, so a
# linear first layer maps them once, not once per point (jaxamp.laplacian).
deriv_scale_p = jcore.Primitive("jaxamp_deriv_scale")


def _scale_shape(v, scalar: bool = False, **_) -> Tuple[int, ...]:
    return () if scalar else tuple(jnp.shape(v))


def _scale_impl(v, **params):
    if params.get("required"):  # evaluated or compiled where no scale was given to it
        warnings.warn(UNINTERPRETED, UnscaledDerivativeWarning, stacklevel=2)
    return jnp.ones(_scale_shape(v, **params), jnp.float32)


class UnscaledDerivativeWarning(UserWarning):
    """A derivative through a float16 ``autocast`` network runs unscaled (scale 1, unchecked)."""


# What a `required` scale (one the network boundary wrote: jaxamp._src.core.boundary) says when
# it is evaluated or compiled outside jaxamp.scaled, where no scale is given to it.
UNINTERPRETED = (
    "jaxamp: an input derivative of a float16 jaxamp.autocast network (a jax.grad / jax.jacfwd / "
    "jax.hessian / jax.jvp through it) is evaluated outside jaxamp.scaled / jaxamp.value_and_grad: it "
    "runs at scale 1, unchecked, and float16 may overflow (inf/NaN). Fix: evaluate it under the AMP "
    "state, jaxamp.scaled(fn)(amp_state, *args)[0] (e.g. a residual after training), compute the "
    "step's gradients with jaxamp.value_and_grad, or call the network without autocast (float32) there."
)


def _scale_jvp(primals, tangents, **params):
    out = deriv_scale_p.bind(*primals, **params)
    return out, ad.Zero(jax.core.ShapedArray(jnp.shape(out), jnp.float32))


def _scale_batch(args, dims, **params):
    return deriv_scale_p.bind(*args, **params), None if params.get("scalar") else dims[0]


deriv_scale_p.def_impl(_scale_impl)
deriv_scale_p.def_abstract_eval(lambda v, **params: jax.core.ShapedArray(_scale_shape(v, **params), jnp.float32))
ad.primitive_jvps[deriv_scale_p] = _scale_jvp
batching.primitive_batchers[deriv_scale_p] = _scale_batch
mlir.register_lowering(deriv_scale_p, mlir.lower_fun(_scale_impl, multiple_results=False))
RULES[deriv_scale_p] = PrimitiveRules(taylor="constant")  # its operand gives its shape only

# ---------------------------------------------------------------- deriv_check_p
# deriv_check_p(g, v) -> g, the scaled gradient of v (one scalar per point): a key overflows
# where v is finite and g is not; a non-finite v is a bad value. At order 0, v = g is a value
# the program holds. The batching rule keeps v.shape == g.shape[:v.ndim] (batch dims lead).
deriv_check_p = jcore.Primitive("jaxamp_deriv_check")


def _check_impl(g, v, **_):
    return g


def _check_jvp(primals, tangents, **params):
    # The primal is checked; the tangent passes through unchecked (a derivative of this
    # derivative is checked by its own deriv_check_p), so no transpose rule is needed.
    (g, v), (g_dot, _) = primals, tangents
    out = deriv_check_p.bind(g, v, **params)
    if type(g_dot) is ad.Zero:
        return out, ad.Zero(jax.core.ShapedArray(g.shape, g_dot.aval.dtype))
    return out, g_dot


def _check_batch(args, dims, **params):
    (g, v), (dg, dv) = args, dims
    size = g.shape[dg] if dg is not None else v.shape[dv]  # None: not batched
    g, v = batching.bdim_at_front(g, dg, size), batching.bdim_at_front(v, dv, size)
    return deriv_check_p.bind(g, v, **params), 0


deriv_check_p.def_impl(_check_impl)
deriv_check_p.def_abstract_eval(lambda g, v, **_: jax.core.ShapedArray(g.shape, g.dtype))
ad.primitive_jvps[deriv_check_p] = _check_jvp
# Linear in g (the identity): in a transposed program the check is on the cotangent side's own
# marks (jaxamp._src.core.boundary), so the cotangent passes through.
ad.primitive_transposes[deriv_check_p] = lambda ct, g, v, **_: [ct, None]
batching.primitive_batchers[deriv_check_p] = _check_batch
mlir.register_lowering(deriv_check_p, mlir.lower_fun(_check_impl, multiple_results=False))
RULES[deriv_check_p] = PrimitiveRules(taylor="linear")  # the identity on its first operand

PRIMITIVES = frozenset((deriv_scale_p, deriv_check_p))


def deriv_scale(v: jax.Array, *, order: int, term: Optional[str], wrt: Optional[str] = None,
                scalar: bool = False) -> jax.Array:
    """The scale of a derivative ``order`` steps above ``v`` (f32, ``v``'s shape, or ``()`` with
    ``scalar``: unbatched under vmap); 1.0 outside ``scaled``. ``term``: the differentiated
    value's name (None: from the program); ``wrt``: the variable's name (None: unnamed).
    :mod:`jaxamp._src.core.nesting` gives the step's order."""
    if scalar:
        return deriv_scale_p.bind(v, order=order, term=term, wrt=wrt, scalar=True)
    return deriv_scale_p.bind(v, order=order, term=term, wrt=wrt)


def fresh(x: Any) -> Any:
    """``x`` (a pytree) marked as the variable a derivative is taken along: whatever derivatives
    ``x`` was computed from, a step along it differentiates the function, not ``x``
    (:mod:`jaxamp._src.core.nesting`). Identity on values (no operation in the compiled program); non-float
    leaves pass as they are."""

    def one(a):
        if not hasattr(a, "dtype") or not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
            return a
        return deriv_check_p.bind(a, a, order=0, term=None, wrt=None, check=False)

    return jax.tree_util.tree_map(one, x)


def deriv_check(g: jax.Array, v: jax.Array, *, order: int, term: Optional[str], wrt: Optional[str] = None,
                check: bool = True) -> jax.Array:
    """``g``, the scaled derivative ``order`` steps above ``v``, marked for the overflow check of
    its key (``order`` 0: ``g`` is a value, checked for bad values). ``check=False`` only
    names ``g`` as that derivative (its order and name for the marks above it)."""
    return deriv_check_p.bind(g, v, order=order, term=term, wrt=wrt, check=check)


def flags_only(jaxpr: jcore.Jaxpr) -> frozenset:
    """The variables of ``jaxpr`` whose values reach its outputs only as flags: read by a scale
    (for its shape and order), as the value below a check (whether it is finite), or by
    equations whose own results are such variables (a check of a derivative nobody reads). A
    check decides only where the value below it is finite, so the value below can be any other
    of the same order that the program computes: the Derivatives engine's own levels. Inside
    a call, loop or branch, and in an equation with effects, every operand is a value."""
    values = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive is deriv_scale_p:
            continue
        if eqn.primitive is deriv_check_p:
            if eqn.outvars[0] in values and isinstance(eqn.invars[0], jcore.Var):
                values.add(eqn.invars[0])
            continue
        if eqn.effects or list(jcore.jaxprs_in_params(eqn.params)) or any(v in values for v in eqn.outvars):
            values.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    defined = [*jaxpr.invars, *jaxpr.constvars, *(v for eqn in jaxpr.eqns for v in eqn.outvars)]
    return frozenset(v for v in defined if isinstance(v, jcore.Var) and v not in values)
