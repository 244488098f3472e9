"""Where every derivative sits in float16's window: a derivative-range profiler.

float16 represents magnitudes from its smallest normal, ``2**-14`` (about 6.1e-5), up to
65504 (just under ``2**16``). Under the DerivScaler a derivative of scaler key ``k`` lives in
float16 as ``scale_k * value``, and so do the hidden-layer tangents that produce it. The
profiler evaluates the *same* network graph with every float16/bfloat16 operation promoted
to float32 (so nothing in the profile itself overflows), multiplies each quantity by the
scale of its key and reports, per derivative, per hidden-layer tangent and per key:

- ``log2_max``: log2 of the largest magnitude;
- ``log2_percentiles``: log2 of the magnitudes at :data:`PERCENTILES` (nonzero values);
- ``frac_subnormal`` / ``frac_overflow``: the fractions of nonzero values below float16's
  smallest normal / above its max;
- ``headroom_up`` / ``headroom_down``: powers of two left to the top edge (from the max)
  and to the bottom edge (from the lowest percentile). Negative means outside the window.

:func:`recommend` turns a profile into per-key scales that fit every key inside the window
with a margin, printable as an ``amp:`` YAML block (:meth:`Recommendation.to_yaml`).
Everything is traced: ``jax.jit(profile, static_argnums=0)`` runs every N steps without
recompiling.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp.interpreter import bind, custom_body, eval_jaxpr, sub_jaxpr

FP16_MAX = 65504.0
FP16_SMALLEST_NORMAL = 2.0**-14
LOG2_FP16_MAX = math.log2(FP16_MAX)
LOG2_FP16_SMALLEST_NORMAL = -14.0
PERCENTILES = (1.0, 50.0, 99.0)
_LOW = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


class Range(NamedTuple):
    """The range of one group of values, as float16 holds them (scaled). All ``f32``."""

    log2_max: jax.Array
    log2_percentiles: jax.Array  # [len(PERCENTILES)]
    frac_subnormal: jax.Array
    frac_overflow: jax.Array
    headroom_up: jax.Array
    headroom_down: jax.Array


class Profile(NamedTuple):
    """``derivatives``: one :class:`Range` per derivative name (scaled by its key);
    ``hidden``: per ``"<key>/<input>/layer<i>"``, the hidden-layer tangents of order ``key``
    along one input (per-order keys only); ``keys``: per scaler key, the union of both."""

    derivatives: Dict[str, Range]
    hidden: Dict[str, Range]
    keys: Dict[str, Range]


def value_range(values: jax.Array, scale=1.0) -> Range:
    """The :class:`Range` of ``values * scale`` (any shape; zeros are ignored)."""
    mag = jnp.abs(jnp.ravel(values).astype(jnp.float32)) * jnp.asarray(scale, jnp.float32)
    nonzero = mag > 0
    count = jnp.maximum(jnp.sum(nonzero), 1).astype(jnp.float32)
    log2 = jnp.log2(jnp.where(nonzero, mag, 1.0))
    pct = jnp.where(jnp.any(nonzero), _percentiles(jnp.where(nonzero, log2, jnp.inf), count), -jnp.inf)
    log2_max = jnp.where(jnp.any(nonzero), jnp.max(jnp.where(nonzero, log2, -jnp.inf)), -jnp.inf)
    return Range(
        log2_max=log2_max,
        log2_percentiles=pct,
        frac_subnormal=jnp.sum(nonzero & (mag < FP16_SMALLEST_NORMAL)) / count,
        frac_overflow=jnp.sum(mag > FP16_MAX) / count,
        headroom_up=LOG2_FP16_MAX - log2_max,
        headroom_down=pct[0] - LOG2_FP16_SMALLEST_NORMAL,
    )


def _percentiles(values: jax.Array, count: jax.Array) -> jax.Array:
    """:data:`PERCENTILES` of the ``count`` smallest entries of ``values`` (the rest are +inf),
    interpolated linearly as ``numpy.percentile``; one sort (``jnp.nanpercentile`` compiles
    several times slower)."""
    ordered = jnp.sort(values)
    pos = jnp.asarray(PERCENTILES, jnp.float32) / 100.0 * (count - 1.0)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, count.astype(jnp.int32) - 1)
    frac = pos - lo
    return ordered[lo] * (1.0 - frac) + ordered[hi] * frac


def promote_to_float32(fn: Callable) -> Callable:
    """``fn`` with every float16/bfloat16 operation of its traced program run in float32.

    The same graph (same operations, same order), so the ranges it shows are those of the
    mixed-precision program without its rounding or overflow.
    """

    def promoted(*args):
        closed = jax.make_jaxpr(fn)(*args)
        flat = jax.tree_util.tree_leaves(args)
        outs = eval_jaxpr(closed.jaxpr, [promote_value(c) for c in closed.consts], flat, promote_eqn,
                          literal=promote_value)
        tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *args))
        return jax.tree_util.tree_unflatten(tree, outs)

    return promoted


def promote_eqn(eqn, vals):
    """The interpreter rule of :func:`promote_to_float32`: one equation, float16/bfloat16 run in
    float32 (call and ``custom_jvp``/``custom_vjp`` bodies inlined and promoted)."""
    body = sub_jaxpr(eqn) or custom_body(eqn)
    if body is not None:
        return eval_jaxpr(body.jaxpr, [promote_value(c) for c in body.consts], vals, promote_eqn,
                          literal=promote_value)
    params = {k: (jnp.float32 if is_low_precision(v) else v) for k, v in eqn.params.items()}
    return bind(eqn.replace(params=params), [promote_value(v) for v in vals])


def is_low_precision(dtype) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 (False for anything that is not a dtype)."""
    try:
        return jnp.dtype(dtype) in _LOW
    except TypeError:
        return False


def promote_value(x):
    """``x`` in float32 if it is a float16/bfloat16 array, else ``x``."""
    dtype = getattr(x, "dtype", None)
    return x.astype(jnp.float32) if dtype is not None and jnp.dtype(dtype) in _LOW else x


def layer_outputs(fn: Callable) -> Callable:
    """``x -> [output of every matmul of fn(x)]``: the hidden layers, in program order."""

    def tapped(x):
        closed = jax.make_jaxpr(fn)(x)
        taps = []

        def rule(eqn, vals):
            body = sub_jaxpr(eqn)
            outs = eval_jaxpr(body.jaxpr, body.consts, vals, rule) if body is not None else bind(eqn, vals)
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                taps.extend(outs)
            return outs

        eval_jaxpr(closed.jaxpr, closed.consts, [x], rule)
        return taps

    return tapped


def profile(engine, params, points, scales: Optional[Mapping[str, jax.Array]] = None) -> Profile:
    """The float16 range of every derivative (and hidden-layer tangent) of ``engine``.

    Args:
      engine: a :class:`jaxamp.Derivatives` (its network, names and scaler keys are used).
      params: the network parameters.
      points: collocation points, as ``engine`` takes them.
      scales: ``{key: f32[]}`` current derivative scales (default: every key at 1).

    Returns:
      A :class:`Profile`. Hidden-layer tangents are reported for per-order keys: order 1
      along every input some derivative starts with, order 2 along every input of a pure
      second derivative (the chains the forward engine propagates).

    Example:
      >>> prof = jax.jit(profile, static_argnums=0)(engine, params, points, state.scales)  # doctest: +SKIP
      >>> print(format_profile(prof))  # doctest: +SKIP
    """
    from jaxamp.derivatives import Derivatives

    keys = tuple(engine.scaler_keys)
    scales = {k: jnp.float32(1.0) for k in keys} | dict(scales or {})
    fn32 = promote_to_float32(engine.fn)
    twin = Derivatives(fn32, inputs=engine.inputs, outputs=engine.outputs, derivatives=engine.requested)
    values, _ = twin(params, points)
    derivs, groups = {}, {k: [] for k in keys}
    for name, v in values.items():
        if name in engine.outputs:
            continue
        key = _order_key(engine, name)
        s = scales.get(key, 1.0)
        derivs[name] = value_range(v, s)
        if key in groups:
            groups[key].append(jnp.ravel(v) * s)
    hidden = {}
    x = engine.stack_points(points)
    taps = layer_outputs(lambda z: fn32(params, z))
    paths = [tuple(name.split("__")[1:]) for name in values if name not in engine.outputs]
    along = {1: {p[0] for p in paths}, 2: {p[0] for p in paths if len(p) >= 2 and p[1] == p[0]}}
    for order in (1, 2):
        key = str(order)
        if key not in keys:
            continue
        for i, name in enumerate(engine.inputs):
            if name not in along[order]:
                continue
            e = jnp.zeros((len(engine.inputs),), jnp.float32).at[i].set(1.0)
            first = lambda z: jax.jvp(taps, (z,), (e,))[1]  # noqa: E731
            fn = first if order == 1 else (lambda z: jax.jvp(first, (z,), (e,))[1])
            for j, t in enumerate(jax.vmap(fn)(x)):
                hidden[f"{key}/{name}/layer{j}"] = value_range(t, scales[key])
                groups[key].append(jnp.ravel(t) * scales[key])
    ranges = {k: value_range(jnp.concatenate(g)) for k, g in groups.items() if g}
    return Profile(derivatives=derivs, hidden=hidden, keys=ranges)


def _order_key(engine, name: str) -> str:
    """The scaler key that guards derivative ``name`` (the key of its last step)."""
    parent = name.rsplit("__", 1)[0]
    return engine.scaler_key(parent) if engine.scaler_keys else ""


class Recommendation(NamedTuple):
    """Per-key start scales ``2**scales_log2[key]`` that fit each key in float16's window
    with ``margin_log2`` powers of two to spare at the top, and the matching
    ``custom_max_scales_log2`` (only for keys below the default max scale)."""

    scales_log2: Dict[str, int]
    custom_max_scales_log2: Dict[str, int]
    margin_log2: int

    def apply(self, amp):
        """``amp`` with these max scales added to its ``custom_max_scales_log2``: every key then
        starts at its recommended scale (a key whose max lies below the default init scale
        starts at its max) and never grows past it.

        Example:
          >>> amp = recommend(profile(engine, params, points)).apply(amp)  # doctest: +SKIP
        """
        import dataclasses

        custom = dict(amp.custom_max_scales_log2)
        custom.update(self.custom_max_scales_log2)
        return dataclasses.replace(amp, custom_max_scales_log2=custom)

    def to_yaml(self) -> str:
        """An ``amp:`` block to paste into a config."""
        items = sorted(self.custom_max_scales_log2.items())
        body = "".join(f'\n    "{k}": {v}' for k, v in items) if items else " {}"
        return f"amp:\n  custom_max_scales_log2:{body}\n"


def check_margin(margin_log2, caller: str) -> None:
    """Raise unless ``margin_log2`` is an integer in [0, 15] (powers of two below 65504)."""
    if isinstance(margin_log2, bool) or not isinstance(margin_log2, int) or not 0 <= margin_log2 <= 15:
        raise ValueError(f"{caller}: `margin_log2`={margin_log2!r} must be an integer in [0, 15].")


def recommend(prof: Profile, *, margin_log2: int = 2, default_max_scale_log2: int = 0) -> Recommendation:
    """Start scales from a (host-side, concrete) :class:`Profile` measured at scale 1.

    Args:
      prof: a profile computed with every scale 1 (the unscaled ranges).
      margin_log2: powers of two kept free below 65504 (a key's max lands at ``2**(16 - 1 -
        margin)`` or lower).
      default_max_scale_log2: the config's default max scale exponent; keys that fit at it
        get no custom entry.

    Returns:
      A :class:`Recommendation`.
    """
    check_margin(margin_log2, "recommend")
    scales, custom = {}, {}
    for key, r in prof.keys.items():
        top = float(np.asarray(r.log2_max))
        exp = default_max_scale_log2 if not math.isfinite(top) else min(
            default_max_scale_log2, math.floor(LOG2_FP16_MAX - margin_log2 - top))
        exp = max(exp, -126)
        scales[key] = exp
        if exp < default_max_scale_log2:
            custom[key] = exp
    return Recommendation(scales_log2=scales, custom_max_scales_log2=custom, margin_log2=margin_log2)


def format_profile(prof: Profile) -> str:
    """A fixed-width table of a concrete profile: one row per key, derivative and layer."""
    head = f"{'quantity':<28}{'log2 max':>9}{'p1':>7}{'p50':>7}{'p99':>7}{'<normal':>9}{'>max':>7}{'up':>6}{'down':>6}"
    rows = [head]
    for title, group in (("key", prof.keys), ("derivative", prof.derivatives), ("hidden", prof.hidden)):
        for name, r in group.items():
            p = np.asarray(r.log2_percentiles)
            rows.append(
                f"{title + ' ' + name:<28}{float(r.log2_max):>9.1f}{p[0]:>7.1f}{p[1]:>7.1f}{p[2]:>7.1f}"
                f"{float(r.frac_subnormal):>9.3f}{float(r.frac_overflow):>7.3f}"
                f"{float(r.headroom_up):>6.1f}{float(r.headroom_down):>6.1f}"
            )
    return "\n".join(rows)
