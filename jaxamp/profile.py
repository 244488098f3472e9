"""Where every derivative sits in float16's window: a derivative-range profiler.

float16 represents magnitudes from its smallest normal, ``2**-14`` (about 6.1e-5), up to
65504 (just under ``2**16``). Under the DerivScaler a derivative of scaler key ``k`` lives in
float16 as ``scale_k * value``, and so do the hidden-layer tangents that produce it. The
profiler evaluates the *same* network graph with every float16/bfloat16 operation promoted
to float32 (so nothing in the profile itself overflows), multiplies each quantity by the
scale of its key and reports a :class:`Range` (the columns of :data:`LEGEND`) per derivative,
hidden-layer tangent and key (:func:`format_profile`: a table). :func:`recommend` turns it into
per-key *start* scales that fit every key in the window with a margin (:meth:`Recommendation.apply`:
``custom_init_scales_log2``; max scales unchanged). ``jax.jit(profile, static_argnums=0)``: one compile.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
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
NOTHING_TO_CHANGE = "# nothing to change: every key fits at its configured start scale\n"  # an empty to_yaml()


class Range(NamedTuple):
    """The range of one group of values, as float16 holds them (scaled). All ``f32``; the
    fields are the columns of :data:`LEGEND` (``-inf`` max and percentiles: no nonzero value)."""

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
    flat = jnp.ravel(values).astype(jnp.float32) if jnp.size(values) else jnp.zeros((1,), jnp.float32)  # empty
    mag = jnp.abs(flat) * jnp.asarray(scale, jnp.float32)
    nonzero = mag > 0
    count = jnp.maximum(jnp.sum(nonzero), 1).astype(jnp.float32)
    log2 = jnp.log2(jnp.where(nonzero, mag, 1.0))
    pct = jnp.where(jnp.any(nonzero), _percentiles(jnp.where(nonzero, log2, jnp.inf), count), -jnp.inf)
    log2_max = jnp.where(jnp.any(nonzero), jnp.max(jnp.where(nonzero, log2, -jnp.inf)), -jnp.inf)
    return Range(log2_max=log2_max, log2_percentiles=pct,
                 frac_subnormal=jnp.sum(nonzero & (mag < FP16_SMALLEST_NORMAL)) / count,
                 frac_overflow=jnp.sum(mag > FP16_MAX) / count,
                 headroom_up=LOG2_FP16_MAX - log2_max, headroom_down=pct[0] - LOG2_FP16_SMALLEST_NORMAL)


def _percentiles(values: jax.Array, count: jax.Array) -> jax.Array:
    """:data:`PERCENTILES` of the ``count`` smallest entries of ``values`` (the rest are +inf),
    interpolated linearly as ``numpy.percentile``; one sort (``jnp.nanpercentile`` compiles slower)."""
    ordered = jnp.sort(values)
    pos = jnp.asarray(PERCENTILES, jnp.float32) / 100.0 * (count - 1.0)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, count.astype(jnp.int32) - 1)
    frac = pos - lo
    return ordered[lo] * (1.0 - frac) + ordered[hi] * frac


def promote_to_float32(fn: Callable) -> Callable:
    """``fn`` with every float16/bfloat16 operation of its traced program run in float32: the
    same graph, so its ranges are the mixed-precision program's without rounding or overflow."""

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

    Example (``u = w sin(x)`` with ``w = 2**18``: both keys overflow float16 at scale 1):
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> from jaxamp.profile import profile, format_profile
      >>> engine = jaxamp.Derivatives(lambda p, x: p["w"] * jnp.sin(x), inputs=("x",), outputs=("u",),
      ...                             derivatives=("u__x__x",), amp=jaxamp.AmpConfig(dtype="float16"))
      >>> points = {"x": jnp.linspace(0.0, 1.0, 8)}
      >>> prof = jax.jit(profile, static_argnums=0)(engine, {"w": jnp.float32(2.0**18)}, points)
      >>> sorted(prof.keys), sorted(prof.derivatives), float(prof.keys["1"].log2_max)
      (['1', '2'], ['u__x', 'u__x__x'], 18.0)
      >>> print(format_profile(prof, legend=False))
      quantity                     log2 max     p1    p50    p99  <normal   >max    up  down
      key 1                            18.0   17.1   17.8   18.0    0.000  1.000  -2.0  31.1
      key 2                            17.8   15.2   17.1   17.7    0.000  0.857  -1.8  29.2
      derivative u__x                  18.0   17.1   17.8   18.0    0.000  1.000  -2.0  31.1
      derivative u__x__x               17.8   15.2   17.1   17.7    0.000  0.857  -1.8  29.2
    """
    from jaxamp.derivatives.engine import Derivatives

    keys = tuple(engine.scaler_keys)
    scales = {k: jnp.float32(1.0) for k in keys} | dict(scales or {})
    fn32 = promote_to_float32(engine.fn)
    twin = Derivatives(fn32, inputs=engine.inputs, outputs=engine.outputs, derivatives=engine.requested)
    values, _ = twin(params, points)
    derivs, groups = {}, {k: [] for k in keys}
    for name in (n for n in values if n not in engine.outputs):
        key = engine.scaler_key(name.rsplit("__", 1)[0]) if keys else ""  # the key of its last step
        derivs[name] = value_range(values[name], s := scales.get(key, 1.0))
        groups.get(key, []).append(jnp.ravel(values[name]) * s)
    hidden, x = {}, engine.stack_points(points)
    taps = layer_outputs(lambda z: fn32(params, z))
    paths = [tuple(name.split("__")[1:]) for name in values if name not in engine.outputs]
    along = {1: {p[0] for p in paths}, 2: {p[0] for p in paths if len(p) >= 2 and p[1] == p[0]}}
    for order, key in ((1, "1"), (2, "2")):
        for i, name in enumerate(engine.inputs if key in keys else ()):
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


class Recommendation(NamedTuple):
    """Per-key start scales ``2**scales_log2[key]`` that fit each key in float16's window
    with ``margin_log2`` powers of two to spare at the top, and ``custom_init_scales_log2``:
    the keys that must start below the default max scale (empty: nothing to change)."""

    scales_log2: Dict[str, int]
    custom_init_scales_log2: Dict[str, int]
    margin_log2: int

    def apply(self, amp):
        """``amp`` (a :class:`jaxamp.AmpConfig`) with these start scales in its
        ``custom_init_scales_log2``.

        Returns:
          A copy in which every recommended key starts at its scale, or at its own max scale
          if that is lower. Max scales are unchanged: a key grows back up to its max.

        Example:
          >>> import jaxamp
          >>> from jaxamp.profile import Recommendation
          >>> rec = Recommendation(scales_log2={"1": 0, "2": -6}, custom_init_scales_log2={"2": -6}, margin_log2=2)
          >>> amp = rec.apply(jaxamp.AmpConfig(dtype="float16", custom_max_scales_log2={"2": -8}))
          >>> dict(amp.custom_init_scales_log2)  # -6 is above key "2"'s max scale 2**-8
          {'2': -8}
        """
        starts = dict(amp.custom_init_scales_log2)
        starts.update({k: min(v, amp.max_scale_log2(k)) for k, v in self.custom_init_scales_log2.items()})
        return dataclasses.replace(amp, custom_init_scales_log2=starts)

    def to_yaml(self) -> str:
        """An ``amp:`` block of ``custom_init_scales_log2`` to paste into a config, or, when
        no key has to start lower, :data:`NOTHING_TO_CHANGE` (a YAML comment line)."""
        items = "".join(f'\n    "{k}": {v}' for k, v in sorted(self.custom_init_scales_log2.items()))
        return f"amp:\n  custom_init_scales_log2:{items}\n" if items else NOTHING_TO_CHANGE


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
      default_max_scale_log2: the config's default max scale exponent: no start is above it,
        and keys that fit at it get no ``custom_init_scales_log2`` entry.

    Returns:
      A :class:`Recommendation`: a key whose largest value ``m`` (``prof.keys``) needs it
      starts at ``2**floor(log2(65504) - margin_log2 - log2(m))``; an all-zero key at the default.

    Example (``u = w sin(x)``, ``|u__x| <= 2**18``: key ``"1"`` starts at
    ``2**floor(15.99 - 2 - 18) = 2**-5``):
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> from jaxamp.profile import profile, recommend
      >>> amp = jaxamp.AmpConfig(dtype="float16")
      >>> engine = jaxamp.Derivatives(lambda p, x: p["w"] * jnp.sin(x), inputs=("x",), outputs=("u",),
      ...                             derivatives=("u__x__x",), amp=amp)
      >>> prof = jax.jit(profile, static_argnums=0)(engine, {"w": jnp.float32(2.0**18)}, {"x": jnp.linspace(0.0, 1.0, 8)})
      >>> rec = recommend(prof)
      >>> print(rec.to_yaml(), end="")
      amp:
        custom_init_scales_log2:
          "1": -5
          "2": -4
      >>> rec.apply(amp).derivative_scaler_for("1").init_scale == 2.0**-5
      True
    """
    check_margin(margin_log2, "recommend")
    scales, custom = {}, {}
    for key, r in prof.keys.items():
        top = float(np.asarray(r.log2_max))
        fit = math.floor(LOG2_FP16_MAX - margin_log2 - top) if math.isfinite(top) else default_max_scale_log2
        scales[key] = exp = max(min(default_max_scale_log2, fit), -126)
        if exp < default_max_scale_log2:
            custom[key] = exp
    return Recommendation(scales_log2=scales, custom_init_scales_log2=custom, margin_log2=margin_log2)


LEGEND = """\
columns: magnitudes as float16 holds them (times the key's scale); zeros are left out
  log2 max    log2 of the largest magnitude
  p1 p50 p99  log2 of the 1st / 50th / 99th percentiles of the nonzero magnitudes
  <normal     fraction of the nonzero values below float16's smallest normal 2^-14
  >max        fraction of the nonzero values above float16's max 65504
  up / down   headroom in powers of two, from log2 max up to 65504 / from p1 down to 2^-14;
              negative: outside float16's window by that much (overflow / underflow)
rows: key K = every value scaler K scales (what recommend fits); derivative, hidden: parts"""


def format_profile(prof: Profile, *, legend: bool = True) -> str:
    """A fixed-width table of a concrete profile: one row per key, derivative and layer.

    {LEGEND}

    Args:
      prof: a concrete :class:`Profile` (e.g. from a jitted :func:`profile`).
      legend: print that legend (:data:`LEGEND`) below the table.

    Returns:
      The table as text; a group without nonzero values reads "all zero / no values".

    Example (a one-hidden-layer network: its layers' tangents get rows of their own):
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> from jaxamp.profile import profile, format_profile
      >>> net = lambda p, x: jnp.tanh(x @ p["w1"]) @ p["w2"]
      >>> params = {"w1": jnp.full((1, 4), 2.0), "w2": jnp.full((4, 1), 2.0**12)}
      >>> engine = jaxamp.Derivatives(net, inputs=("x",), outputs=("u",), derivatives=("u__x__x",),
      ...                             amp=jaxamp.AmpConfig(dtype="float16"))
      >>> prof = jax.jit(profile, static_argnums=0)(engine, params, {"x": jnp.linspace(-1.0, 1.0, 16)})
      >>> print(format_profile(prof))  # doctest: +ELLIPSIS
      quantity                     log2 max     p1    p50    p99  <normal   >max    up  down
      key 1                            15.0    1.0    1.0   15.0    0.000  0.000   1.0  15.0
      key 2                            15.6   13.1   14.7   15.6    0.000  0.000   0.4  27.1
      derivative u__x                  15.0   11.2   13.6   15.0    0.000  0.000   1.0  25.2
      derivative u__x__x               15.6   13.1   14.7   15.6    0.000  0.000   0.4  27.1
      hidden 1/x/layer0                 1.0    1.0    1.0    1.0    0.000  0.000  15.0  15.0
      hidden 1/x/layer1                15.0   11.2   13.6   15.0    0.000  0.000   1.0  25.2
      hidden 2/x/layer0              all zero / no values
      hidden 2/x/layer1                15.6   13.1   14.7   15.6    0.000  0.000   0.4  27.1
      <BLANKLINE>
      columns: magnitudes as float16 holds them (times the key's scale); zeros are left out
      ...
    """
    rows = [f"{'quantity':<28}{'log2 max':>9}" + "".join(f"{'p' + format(q, 'g'):>7}" for q in PERCENTILES)
            + f"{'<normal':>9}{'>max':>7}{'up':>6}{'down':>6}"]
    for title, group in (("key", prof.keys), ("derivative", prof.derivatives), ("hidden", prof.hidden)):
        for name, r in group.items():
            top, p, row = float(r.log2_max), np.asarray(r.log2_percentiles, np.float64), f"{title + ' ' + name:<28}"
            if not (math.isfinite(top) and np.all(np.isfinite(p))):
                rows.append(row + ("   all zero / no values" if top == -math.inf else "   non-finite values (inf)"))
                continue
            rows.append(row + f"{top:>9.1f}" + "".join(f"{v:>7.1f}" for v in p)
                        + f"{float(r.frac_subnormal):>9.3f}{float(r.frac_overflow):>7.3f}"
                        f"{float(r.headroom_up):>6.1f}{float(r.headroom_down):>6.1f}")
    rows += [] if len(rows) > 1 else ["(no scaled values: derivative scaling is off, or nothing is differentiated)"]
    return "\n".join(rows + ["", LEGEND] * legend)


if format_profile.__doc__:  # the legend in the docstring (help(), docs) is the one printed
    format_profile.__doc__ = format_profile.__doc__.replace("{LEGEND}", textwrap.indent(LEGEND, "    ").lstrip())
