"""float16's window (``2**-14`` to 65504): :class:`Range` and :class:`Profile` (what
:func:`jaxamp.profile` measures), start scales (:func:`recommend`) and :func:`format_profile`.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import Callable, Dict, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.core.interpreter import bind, custom_body, eval_jaxpr, sub_jaxpr

__all__ = [
    "FP16_MAX", "FP16_SMALLEST_NORMAL", "LOG2_FP16_MAX", "LOG2_FP16_SMALLEST_NORMAL", "PERCENTILES",
    "NOTHING_TO_CHANGE", "Range", "Profile", "value_range", "promote_to_float32", "promote_eqn", "is_low_precision",
    "promote_value", "Recommendation", "check_margin", "recommend", "LEGEND", "format_profile"
]

FP16_MAX = 65504.0
FP16_SMALLEST_NORMAL = 2.0**-14
LOG2_FP16_MAX = math.log2(FP16_MAX)
LOG2_FP16_SMALLEST_NORMAL = -14.0
PERCENTILES = (1.0, 50.0, 99.0)
_LOW = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
NOTHING_TO_CHANGE = "# nothing to change: every key fits at its configured start scale\n"  # an empty to_yaml()


class Range(NamedTuple):
    """The range of one group of values, as float16 holds them (scaled): the ``f32`` columns of
    :data:`LEGEND` (``-inf`` max and percentiles: no nonzero value)."""

    log2_max: jax.Array
    log2_percentiles: jax.Array  # [len(PERCENTILES)]
    frac_subnormal: jax.Array
    frac_overflow: jax.Array
    headroom_up: jax.Array
    headroom_down: jax.Array


class Profile(NamedTuple):
    """What :func:`jaxamp.profile` measures, per scaler key: ``derivatives``: the scaled
    derivatives the key's checks look at; ``hidden``: the float16/bfloat16 values of the passes
    the key's seed scales; ``keys``: those values of both (what :func:`recommend` fits). And per
    matmul operand role and format (``"tangent float8_e4m3fn"``), with per-tensor scaling or FP8:
    ``operands``, the operands as their format holds them (after their per-tensor scales),
    against that format's window."""

    derivatives: Dict[str, Range]
    hidden: Dict[str, Range]
    keys: Dict[str, Range]
    operands: Dict[str, Range] = {}

    def recommend(self, *, margin_log2: int = 2, default_max_scale_log2: int = 0) -> "Recommendation":
        """Start scales that fit this profile (measured at scale 1): :func:`recommend`."""
        return recommend(self, margin_log2=margin_log2, default_max_scale_log2=default_max_scale_log2)

    def format(self, *, legend: bool = True) -> str:
        """This profile as a fixed-width table: :func:`format_profile`."""
        return format_profile(self, legend=legend)


def value_range(values: jax.Array, scale=1.0, dtype=jnp.float16) -> Range:
    """The :class:`Range` of ``values * scale`` (any shape; zeros are ignored) in ``dtype``'s
    window (float16's: ``2**-14`` to 65504; an FP8 format's for matmul operands)."""
    info = jnp.finfo(dtype)
    top, bottom = float(info.max), float(info.smallest_normal)
    flat = jnp.ravel(values).astype(jnp.float32) if jnp.size(values) else jnp.zeros((1,), jnp.float32)  # empty
    mag = jnp.abs(flat) * jnp.asarray(scale, jnp.float32)
    nonzero = mag > 0
    count = jnp.maximum(jnp.sum(nonzero), 1).astype(jnp.float32)
    log2 = jnp.log2(jnp.where(nonzero, mag, 1.0))
    has = jnp.any(nonzero)
    # PERCENTILES of the nonzero values as numpy's: the zeros sort last as +inf
    ordered = jnp.sort(jnp.where(nonzero, log2, jnp.inf))
    pos = jnp.asarray(PERCENTILES, jnp.float32) / 100.0 * (count - 1.0)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi, frac = jnp.minimum(lo + 1, count.astype(jnp.int32) - 1), pos - lo
    pct = jnp.where(has, ordered[lo] * (1.0 - frac) + ordered[hi] * frac, -jnp.inf)
    log2_max = jnp.where(has, jnp.max(jnp.where(nonzero, log2, -jnp.inf)), -jnp.inf)
    return Range(log2_max=log2_max, log2_percentiles=pct,
                 frac_subnormal=jnp.sum(nonzero & (mag < bottom)) / count, frac_overflow=jnp.sum(mag > top) / count,
                 headroom_up=math.log2(top) - log2_max, headroom_down=pct[0] - math.log2(bottom))


def promote_to_float32(fn: Callable) -> Callable:
    """``fn`` with every float16/bfloat16 operation of its traced program run in float32."""

    def promoted(*args):
        outs = _eval_promoted(jax.make_jaxpr(fn)(*args), jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(jax.eval_shape(fn, *args)), outs)

    return promoted


def _eval_promoted(closed, vals):
    """The outputs of the closed jaxpr ``closed`` on ``vals``, every operation in float32."""
    return eval_jaxpr(closed.jaxpr, [promote_value(c) for c in closed.consts], vals, promote_eqn, literal=promote_value)


def promote_eqn(eqn, vals):
    """The interpreter rule of :func:`promote_to_float32` (call and custom bodies inlined)."""
    body = sub_jaxpr(eqn) or custom_body(eqn)
    if body is not None:
        return _eval_promoted(body, vals)
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
    return x.astype(jnp.float32) if is_low_precision(getattr(x, "dtype", None)) else x


class Recommendation(NamedTuple):
    """Per-key start scales ``2**scales_log2[key]`` that fit float16 with ``margin_log2`` to spare,
    and ``custom_init_scales_log2``: the keys that must start below the default max scale."""

    scales_log2: Dict[str, int]
    custom_init_scales_log2: Dict[str, int]
    margin_log2: int

    def apply(self, amp):
        """``amp`` (a :class:`jaxamp.AmpConfig`) with these ``custom_init_scales_log2`` starts.

        Returns:
          A copy in which every recommended key starts at its scale, or at its max scale if lower.

        Example:
          >>> import jaxamp
          >>> from jaxamp._src.core.window import Recommendation
          >>> rec = Recommendation(scales_log2={"1": 0, "2": -6}, custom_init_scales_log2={"2": -6}, margin_log2=2)
          >>> amp = rec.apply(jaxamp.AmpConfig(dtype="float16", custom_max_scales_log2={"2": -8}))
          >>> dict(amp.custom_init_scales_log2)  # -6 is above key "2"'s max scale 2**-8
          {'2': -8}
        """
        starts = dict(amp.custom_init_scales_log2)
        starts.update({k: min(v, amp.max_scale_log2(k)) for k, v in self.custom_init_scales_log2.items()})
        return dataclasses.replace(amp, custom_init_scales_log2=starts)

    def to_yaml(self) -> str:
        """An ``amp:`` block of ``custom_init_scales_log2``, or :data:`NOTHING_TO_CHANGE`."""
        items = "".join(f'\n    "{k}": {v}' for k, v in sorted(self.custom_init_scales_log2.items()))
        return f"amp:\n  custom_init_scales_log2:{items}\n" if items else NOTHING_TO_CHANGE


def check_margin(margin_log2, caller: str) -> None:
    """Raise unless ``margin_log2`` is an integer in [0, 15] (powers of two below 65504)."""
    if isinstance(margin_log2, bool) or not isinstance(margin_log2, int) or not 0 <= margin_log2 <= 15:
        raise ValueError(f"{caller}: `margin_log2`={margin_log2!r} must be an integer in [0, 15].")


def recommend(prof: Profile, *, margin_log2: int = 2, default_max_scale_log2: int = 0) -> Recommendation:
    """Start scales from a (host-side, concrete) :class:`Profile` measured at scale 1.

    Args:
      prof: a profile computed with every scale 1.
      margin_log2: powers of two kept free below 65504.
      default_max_scale_log2: the config's default max scale exponent: no start is above it.

    Returns:
      A :class:`Recommendation`: a key whose largest value is ``m`` starts at
      ``2**floor(log2(65504) - margin_log2 - log2(m))`` if below the default.

    Example (``u = w sin(x)`` in float16, ``w = 2**15``: both keys reach ``2**14.8``):
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> amp = jaxamp.AmpConfig(dtype="float16")
      >>> u = lambda w, x: (w.astype(jnp.float16) * jnp.sin(x.astype(jnp.float16))).astype(jnp.float32)
      >>> u_xx = jax.vmap(jaxamp.grad(jaxamp.grad(u, 1), 1), (None, 0))
      >>> rec = jaxamp.profile(u_xx, amp)(None, jnp.float32(2.0**15), jnp.linspace(0.5, 1.0, 8)).recommend()
      >>> print(rec.to_yaml(), end="")
      amp:
        custom_init_scales_log2:
          "1": -1
          "2": -1
      >>> rec.apply(amp).derivative_scaler_for("1").init_scale == 2.0**-1
      True
    """
    check_margin(margin_log2, "recommend")
    scales = {}
    for key, r in prof.keys.items():
        top = float(np.asarray(r.log2_max))
        fit = math.floor(LOG2_FP16_MAX - margin_log2 - top) if math.isfinite(top) else default_max_scale_log2
        scales[key] = max(min(default_max_scale_log2, fit), -126)
    custom = {k: exp for k, exp in scales.items() if exp < default_max_scale_log2}
    return Recommendation(scales_log2=scales, custom_init_scales_log2=custom, margin_log2=margin_log2)


LEGEND = """\
columns: magnitudes as float16 holds them (times the key's scale); zeros are left out
  log2 max    log2 of the largest magnitude
  p1 p50 p99  log2 of the 1st / 50th / 99th percentiles of the nonzero magnitudes
  <normal     fraction of the nonzero values below float16's smallest normal 2^-14
  >max        fraction of the nonzero values above float16's max 65504
  up / down   headroom in powers of two, from log2 max up to 65504 / from p1 down to 2^-14;
              negative: outside float16's window by that much (overflow / underflow)
rows: key K = every value scaler K scales (what recommend fits); derivative, hidden: parts;
  operand R F = the matmul operands of role R held in format F (after their per-tensor
  scales), against F's window instead (E4M3: 2^-6 to 448; E5M2: 2^-14 to 57344)"""


def format_profile(prof: Profile, *, legend: bool = True) -> str:
    """A fixed-width table of a concrete profile: one row per key, derivative and layer.

    {LEGEND}

    Args:
      prof: a concrete :class:`Profile`.
      legend: print that legend (:data:`LEGEND`) below the table.

    Returns:
      The table as text; a group without nonzero values reads "all zero / no values".

    Example (a float16 network: both keys' float16 values reach ``2**14.8``):
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> u = lambda w, x: (w.astype(jnp.float16) * jnp.sin(x.astype(jnp.float16))).astype(jnp.float32)
      >>> u_xx = jax.vmap(jaxamp.grad(jaxamp.grad(u, 1), 1), (None, 0))
      >>> prof = jaxamp.profile(u_xx, jaxamp.AmpConfig())(None, jnp.float32(2.0**15), jnp.linspace(0.5, 1.0, 8))
      >>> print(prof.format())  # doctest: +ELLIPSIS
      quantity                     log2 max     p1    p50    p99  <normal   >max    up  down
      key 1                            14.8   -0.9    0.0   14.8    0.000  0.000   1.2  13.1
      key 2                            14.8   -1.1   -0.1   14.7    0.000  0.000   1.2  12.9
      derivative 1                     14.8   14.1   14.5   14.8    0.000  0.000   1.2  28.1
      ...
    """
    groups = (("key", prof.keys), ("derivative", prof.derivatives), ("hidden", prof.hidden), ("operand", prof.operands))
    width = max([28] + [len(f"{title} {name}") + 1 for title, group in groups for name in group])
    rows = [f"{'quantity':<{width}}{'log2 max':>9}" + "".join(f"{'p' + format(q, 'g'):>7}" for q in PERCENTILES)
            + f"{'<normal':>9}{'>max':>7}{'up':>6}{'down':>6}"]
    for title, group in groups:
        for name, r in group.items():
            top, p = float(r.log2_max), np.asarray(r.log2_percentiles, np.float64)
            row = f"{title + ' ' + name:<{width}}"
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
