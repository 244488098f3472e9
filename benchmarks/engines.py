"""Derivative engines, measured against jaxamp's nested reverse mode (the reference path).

Every engine is a ``jaxamp.Derivatives`` (same plan, interface, per-point scales and checks);
the alternatives plug in as point engines, ``Derivatives(..., method=engine)`` with
``engine(plan, f, x, scales) -> (values, scaled)`` (see ``jaxamp._src.derivatives.engine.PointEngine``):

- ``"reverse"``: ``method="reverse"`` (nested reverse mode), the reference.
- ``"forward"``: ``method="forward"``, the default: nested ``jax.jvp``, one pass per
  derivative path, tangents seeded with the scales; pure second orders propagate one tangent
  (``jaxamp._src.taylor.second_order``), pure orders >= 3 take scaled Taylor mode
  (``jaxamp._src.taylor.series``), mixed higher orders are ``jax.jvp`` of the pure second order.
- ``"fwd_nested"``: the forward engine with pure orders >= 3 by nested ``jax.jvp`` of the
  pure second order (the measured alternative to Taylor mode).
- ``"fwd_over_rev"``: order 1 by reverse mode (``jax.jacrev``), every higher order by
  ``jax.jvp`` with the scale ratio as the tangent seed (:func:`forward_over_reverse`).
- ``"jet"``: Taylor mode (``jax.experimental.jet``), one jet per input direction giving
  every order at once. Only pure derivatives (``u__x__x``, not ``u__x__y``) and only
  *unscaled*: a single jet seeds all orders with one number ``t`` (order k sees ``t**k``),
  so per-order scales ``s_k`` cannot be reproduced; it raises for a scaled config. (The
  forward engine's own Taylor mode, ``jaxamp._src.taylor.series``, keeps one scale per order.)
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import jet as jet_mod

import jaxamp
from jaxamp._src.derivatives.plan import Plan, parse_name
from jaxamp._src.derivatives.forward_engine import point_values

KINDS = ("reverse", "forward", "fwd_nested", "fwd_over_rev", "jet")
Values = Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]

# The forward engine with Taylor mode never taken: pure orders >= 3 by nested jax.jvp.
forward_nested = functools.partial(point_values, series_min_order=1 << 30)


def forward_over_reverse(plan: Plan, f: Callable[[jax.Array], jax.Array], x: jax.Array,
                         scales: Mapping[str, jax.Array]) -> Values:
    """A point engine: one chain of nested per-level functions.

    Each level's function returns its *scaled* derivatives (each row times the scale of the
    key that produced it) and, as auxiliary outputs, every level's unscaled values and scaled
    derivatives so far. Order 1: one ``jax.jacrev`` of the outputs, each row's seed scaled.
    Order k >= 2: ``jax.jvp`` of the order-(k-1) function along one input per (scaler key,
    input, key of the parent), the tangent seeded with ``s_k / s_{k-1}``, which by linearity
    is ``s_k`` times the derivative of the unscaled parent. Tangents no derivative needs are
    dead code that XLA removes.
    """
    n_in = len(plan.inputs)
    one = jnp.float32(1.0)

    def by_jacrev(level):
        rows = jnp.asarray(level.parent_rows)
        inv = jnp.stack([one / scales[level.parent_keys[p]] for p in level.child_parent])

        def seeded(z):
            vals = f(z)
            return vals[rows] * jnp.stack([scales[k] for k in level.parent_keys]), vals

        def level_fn(z):
            jac, vals = jax.jacrev(seeded, has_aux=True)(z)
            scaled = jnp.stack([jac[p, col] for p, col in zip(level.child_parent, level.child_input)])
            return scaled, {"values": [vals, scaled * inv], "scaled": [scaled]}

        return level_fn

    def by_jvp(below, level, below_keys: Sequence[str]):
        """``below_keys``: for each row of the level below, the key its scale came from."""
        keys = [level.parent_keys[p] for p in level.child_parent]
        groups: Dict[Tuple[str, int, str], List[int]] = {}
        for c, (key, col) in enumerate(zip(keys, level.child_input)):
            groups.setdefault((key, col, below_keys[level.parent_rows[level.child_parent[c]]]), []).append(c)

        def level_fn(z):
            scaled: List = [None] * len(level.names)
            for (key, col, prev), children in groups.items():
                tangent = jnp.zeros((n_in,), jnp.float32).at[col].set(scales[key] / scales[prev])
                _, tangents, aux = jax.jvp(below, (z,), (tangent,), has_aux=True)
                for c in children:
                    scaled[c] = tangents[level.parent_rows[level.child_parent[c]]]
            stacked = jnp.stack(scaled)
            unscaled = stacked * jnp.stack([one / scales[k] for k in keys])
            return stacked, {"values": aux["values"] + [unscaled], "scaled": aux["scaled"] + [stacked]}

        return level_fn

    fn, produced_by = None, None
    for depth, level in enumerate(plan.levels):
        fn = by_jvp(fn, level, produced_by) if depth else by_jacrev(level)
        produced_by = [level.parent_keys[p] for p in level.child_parent]
    if fn is None:
        return {n: v for n, v in zip(plan.outputs, f(x))}, {}
    _, aux = fn(x)
    values: Dict[str, jax.Array] = {}
    scaled: Dict[str, jax.Array] = {}
    for names, vec in zip([plan.outputs] + [lv.names for lv in plan.levels], aux["values"]):
        values.update({n: vec[i] for i, n in enumerate(names)})
    for level, vec in zip(plan.levels, aux["scaled"]):
        scaled.update({n: vec[i] for i, n in enumerate(level.names)})
    return values, scaled


def jet(plan: Plan, f: Callable[[jax.Array], jax.Array], x: jax.Array, scales: Mapping[str, jax.Array]) -> Values:
    """A point engine: one ``jet`` per input direction gives every pure derivative order at
    once (unscaled, pure derivatives only: see :func:`check_jet`)."""
    n_in = len(plan.inputs)
    directions = sorted({plan.inputs.index(parse_name(n)[1][0]) for n in plan.derivatives})
    values: Dict[str, jax.Array] = {}
    y = f(x)
    for i in directions:
        e = jnp.zeros((n_in,), jnp.float32).at[i].set(1.0)
        series = (e,) + tuple(jnp.zeros((n_in,), jnp.float32) for _ in range(len(plan.levels) - 1))
        y, coeffs = jet_mod.jet(f, (x,), (series,))
        for name in plan.derivatives:
            base, wrt = parse_name(name)
            if wrt[0] == plan.inputs[i]:
                values[name] = coeffs[len(wrt) - 1][plan.outputs.index(base)]
    values.update({o: y[k] for k, o in enumerate(plan.outputs)})
    return values, {}


def check_jet(engine: jaxamp.Derivatives) -> None:
    """Raise unless ``engine``'s plan is one Taylor mode can compute: unscaled, pure derivatives."""
    if engine.scaled:
        raise ValueError(
            f"Jet: amp={engine.amp!r} asks for float16 derivative scaling, which Taylor mode cannot reproduce "
            "(one jet seed t scales order k by t**k, not by its own s_k); use an unscaled amp."
        )
    for name in engine.plan.derivatives:
        if len(set(parse_name(name)[1])) != 1:
            raise ValueError(f"Jet: derivative {name!r} is mixed; Taylor mode here supports pure ones only.")


POINT_ENGINES = {"reverse": "reverse", "forward": "forward", "fwd_nested": forward_nested,
                 "fwd_over_rev": forward_over_reverse, "jet": jet}


def make_engine(kind: str, fn: Callable, *, inputs: Sequence[str], outputs: Sequence[str],
                derivatives: Sequence[str], amp: Optional[jaxamp.AmpConfig] = None) -> jaxamp.Derivatives:
    """A ``jaxamp.Derivatives`` computing with the engine ``kind`` (one of :data:`KINDS`)."""
    if kind not in POINT_ENGINES:
        raise ValueError(f"make_engine: kind={kind!r} is not known: expected one of {list(KINDS)}.")
    engine = jaxamp.Derivatives(fn, inputs=inputs, outputs=outputs, derivatives=derivatives, amp=amp,
                                method=POINT_ENGINES[kind])
    if kind == "jet":
        check_jet(engine)
    return engine


def pure_derivatives(order: int, outputs: Sequence[str] = ("u",),
                     inputs: Sequence[str] = ("x", "y")) -> Tuple[str, ...]:
    """``order`` 2 -> ``("u__x__x", "u__y__y")``: pure derivatives of each output along each input."""
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ValueError(f"pure_derivatives: `order`={order!r} must be an integer >= 1.")
    return tuple(o + "".join("__" + i for _ in range(order)) for o in outputs for i in inputs)


def max_rel_diff(a: Mapping[str, jax.Array], b: Mapping[str, jax.Array]) -> float:
    """Largest ``|a-b| / (max|b| + tiny)`` over the names of ``b`` (each name's own scale)."""
    worst = 0.0
    for k in b:
        d = float(jnp.max(jnp.abs(a[k] - b[k])) / (jnp.max(jnp.abs(b[k])) + 1e-30))
        worst = max(worst, d)
    return worst
