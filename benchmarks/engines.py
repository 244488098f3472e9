"""Alternative derivative engines, for measurement against jaxamp's nested reverse mode.

Each engine has :class:`jaxamp.Derivatives`' interface (``engine(params, points, scales) ->
(values, found_inf)``) and plan (it reuses a ``jaxamp.Derivatives`` for names, levels and
scaler keys), so they are drop-in comparable:

- ``"reverse"``: ``jaxamp.Derivatives`` itself (nested ``jax.jacrev``), the reference.
- ``"fwd_over_rev"``: order 1 by reverse mode (one ``jacrev`` per point, as jaxamp), every
  higher order by forward mode (``jax.jvp`` of the level below, one JVP per input direction
  and scaler key). Scaling has SPEC's semantics: the JVP's *tangent seed* is the scaler's
  scale (``scale * e_i`` instead of ``e_i``), so every float16 tangent carries the scaled
  value; the scaled result is checked for inf/NaN under the key, then multiplied by
  ``1/scale`` in float32 inside the differentiable graph.
- ``"jet"``: Taylor mode (``jax.experimental.jet``), one jet per input direction giving
  every order at once. Only pure derivatives (``u__x__x``, not ``u__x__y``) and only
  *unscaled*: a single jet seeds all orders with one number ``t`` (order k sees ``t**k``),
  so per-order scales ``s_k`` cannot be reproduced; it raises for a scaled config.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import jet as jet_mod

import jaxamp
from jaxamp.derivatives import parse_name

KINDS = ("reverse", "fwd_over_rev", "jet")


class _Alternative:
    """Shared plumbing: the plan of a reference ``jaxamp.Derivatives``."""

    def __init__(self, fn, *, inputs, outputs, derivatives, amp: Optional[jaxamp.AmpConfig] = None) -> None:
        self.ref = jaxamp.Derivatives(fn, inputs=inputs, outputs=outputs, derivatives=derivatives, amp=amp)
        self.fn = fn
        self.inputs, self.outputs, self.levels = self.ref.inputs, self.ref.outputs, self.ref.levels
        self.scaled, self.scaler_keys = self.ref.scaled, self.ref.scaler_keys

    def init_scaler_states(self):
        return self.ref.init_scaler_states()

    def __call__(self, params, points, scales=None) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
        x = self.ref._stack_points(points)
        scales = self.ref._check_scales(scales)
        values, flags = jax.vmap(lambda p: self.point_values(params, p, scales))(x)
        return values, {k: jnp.any(f) for k, f in flags.items()}

    def point_values(self, params, x, scales):  # pragma: no cover - abstract
        raise NotImplementedError


class ForwardOverReverse(_Alternative):
    """Order 1 by ``jax.jacrev``; orders >= 2 by ``jax.jvp`` with the scale as tangent seed."""

    def point_values(self, params, x, scales):
        n_out = len(self.outputs)

        def level0(x):
            return jnp.asarray(self.fn(params, x)).reshape(n_out).astype(jnp.float32), {"values": [], "found_inf": {}}

        fn = level0
        for depth, level in enumerate(self.levels):
            fn = self._reverse_level(fn, level, scales) if depth == 0 else self._forward_level(fn, level, scales)
        top, aux = fn(x)
        values = {}
        for names, vec in zip([self.outputs] + [lv.names for lv in self.levels], aux["values"] + [top]):
            values.update({n: vec[i] for i, n in enumerate(names)})
        return values, aux["found_inf"]

    def _finish(self, level, picked, keys_of_child, scales, aux, vals):
        """Steps 3-4: flag the scaled values per key, unscale in float32."""
        flags = dict(aux["found_inf"])
        if self.scaled:
            bad = ~jnp.isfinite(picked)
            for key in dict.fromkeys(keys_of_child):
                mask = jnp.asarray([k == key for k in keys_of_child])
                hit = jnp.any(bad & mask)
                flags[key] = flags[key] | hit if key in flags else hit
            picked = picked / jnp.stack([scales[k] for k in keys_of_child])
        return picked, {"values": aux["values"] + [vals], "found_inf": flags}

    def _reverse_level(self, below, level, scales):
        rows = jnp.asarray(level.parent_rows)
        keys_of_child = [level.parent_keys[p] for p in level.child_parent]

        def seeded(x):
            vals, aux = below(x)
            parents = vals[rows]
            if self.scaled:
                parents = parents * jnp.stack([scales[k] for k in level.parent_keys])
            return parents, (vals, aux)

        def level_fn(x):
            jac, (vals, aux) = jax.jacrev(seeded, has_aux=True)(x)
            picked = jac[jnp.asarray(level.child_parent), jnp.asarray(level.child_input)]
            return self._finish(level, picked, keys_of_child, scales, aux, vals)

        return level_fn

    def _forward_level(self, below, level, scales):
        keys_of_child = [level.parent_keys[p] for p in level.child_parent]
        groups: Dict[Tuple[str, int], List[int]] = {}
        for c, (key, i) in enumerate(zip(keys_of_child, level.child_input)):
            groups.setdefault((key, i), []).append(c)
        n_in = len(self.inputs)

        def level_fn(x):
            picked: List = [None] * len(level.names)
            for (key, i), children in groups.items():
                seed = scales[key] if self.scaled else jnp.float32(1.0)
                tangent = jnp.zeros((n_in,), jnp.float32).at[i].set(seed)
                vals, tvals, aux = jax.jvp(below, (x,), (tangent,), has_aux=True)
                for c in children:
                    picked[c] = tvals[level.parent_rows[level.child_parent[c]]]
            return self._finish(level, jnp.stack(picked), keys_of_child, scales, aux, vals)

        return level_fn


class Jet(_Alternative):
    """Taylor mode: one ``jet`` per input direction gives every pure derivative order at once."""

    def __init__(self, fn, *, inputs, outputs, derivatives, amp=None) -> None:
        super().__init__(fn, inputs=inputs, outputs=outputs, derivatives=derivatives, amp=amp)
        if self.scaled:
            raise ValueError(
                f"Jet: amp={amp!r} asks for float16 derivative scaling, which Taylor mode cannot reproduce "
                "(one jet seed t scales order k by t**k, not by its own s_k); use an unscaled amp."
            )
        for name in (n for lv in self.levels for n in lv.names):
            base, wrt = parse_name(name)
            if len(set(wrt)) != 1:
                raise ValueError(f"Jet: derivative {name!r} is mixed; Taylor mode here supports pure ones only.")
        self.directions = sorted({self.inputs.index(parse_name(n)[1][0]) for lv in self.levels for n in lv.names})
        self.max_order = len(self.levels)

    def point_values(self, params, x, scales):
        n_in, n_out = len(self.inputs), len(self.outputs)
        f = lambda z: jnp.asarray(self.fn(params, z)).reshape(n_out).astype(jnp.float32)  # noqa: E731
        values: Dict[str, jax.Array] = {}
        y = None
        for i in self.directions:
            e = jnp.zeros((n_in,), jnp.float32).at[i].set(1.0)
            series = (e,) + tuple(jnp.zeros((n_in,), jnp.float32) for _ in range(self.max_order - 1))
            y, coeffs = jet_mod.jet(f, (x,), (series,))
            for name in (n for lv in self.levels for n in lv.names):
                base, wrt = parse_name(name)
                if wrt[0] == self.inputs[i]:
                    values[name] = coeffs[len(wrt) - 1][self.outputs.index(base)]
        values.update({o: y[k] for k, o in enumerate(self.outputs)})
        return values, {}


def make_engine(kind: str, fn: Callable, *, inputs: Sequence[str], outputs: Sequence[str],
                derivatives: Sequence[str], amp: Optional[jaxamp.AmpConfig] = None):  # fmt: skip
    """An engine of ``kind`` (one of :data:`KINDS`) with ``jaxamp.Derivatives``' interface."""
    kw = dict(inputs=inputs, outputs=outputs, derivatives=derivatives, amp=amp)
    if kind == "reverse":
        return jaxamp.Derivatives(fn, **kw)
    if kind == "fwd_over_rev":
        return ForwardOverReverse(fn, **kw)
    if kind == "jet":
        return Jet(fn, **kw)
    raise ValueError(f"make_engine: kind={kind!r} is not known: expected one of {list(KINDS)}.")


def pure_derivatives(order: int, outputs: Sequence[str] = ("u",), inputs: Sequence[str] = ("x", "y")) -> Tuple[str, ...]:
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
