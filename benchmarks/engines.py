"""Derivative engines, measured against jaxamp's nested reverse mode (the reference path).

Each engine has :class:`jaxamp.Derivatives`' interface (``engine(params, points, scales) ->
(values, found_inf)``) and plan (it reuses a ``jaxamp.Derivatives`` for names, levels and
scaler keys), so they are drop-in comparable:

- ``"reverse"``: ``jaxamp.Derivatives(method="reverse")`` (nested reverse mode), the reference.
- ``"forward"``: ``jaxamp.Derivatives(method="forward")``, the default: nested ``jax.jvp``,
  one chain per derivative path, tangents seeded with the scales; pure second orders
  propagate one tangent (``jaxamp.taylor``), pure orders >= 3 take scaled Taylor mode
  (``jaxamp.taylor_series``), mixed higher orders are ``jax.jvp`` of the pure second order.
- ``"fwd_nested"``: the forward engine with pure orders >= 3 by nested ``jax.jvp`` of the
  pure second order, as before ``jaxamp.taylor_series`` (the measured alternative).
- ``"fwd_over_rev"``: ``jaxamp.Derivatives(method="forward_over_reverse")``: order 1 by
  reverse mode, every higher order by ``jax.jvp`` with the scale as the tangent seed (it
  started here as a benchmark-only engine and moved into the core).
- ``"jet"``: Taylor mode (``jax.experimental.jet``), one jet per input direction giving
  every order at once. Only pure derivatives (``u__x__x``, not ``u__x__y``) and only
  *unscaled*: a single jet seeds all orders with one number ``t`` (order k sees ``t**k``),
  so per-order scales ``s_k`` cannot be reproduced; it raises for a scaled config. (The
  forward engine's own Taylor mode, ``jaxamp.taylor_series``, keeps one scale per order.)
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import jet as jet_mod

import jaxamp
from jaxamp import derivatives as D
from jaxamp.derivatives import parse_name

KINDS = ("reverse", "forward", "fwd_nested", "fwd_over_rev", "jet")


class _Alternative:
    """Shared plumbing: the plan of a reference ``jaxamp.Derivatives``."""

    def __init__(self, fn, *, inputs, outputs, derivatives, amp: Optional[jaxamp.AmpConfig] = None) -> None:
        self.ref = jaxamp.Derivatives(fn, inputs=inputs, outputs=outputs, derivatives=derivatives, amp=amp,
                                      method="reverse")
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


class ForwardNested(_Alternative):
    """``jaxamp.Derivatives(method="forward")`` with pure orders >= 3 by nested ``jax.jvp``."""

    def point_values(self, params, x, scales):
        return D._forward(self.ref, params, x, scales, series_min_order=1 << 30)


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
    if kind in ("reverse", "forward"):
        return jaxamp.Derivatives(fn, **kw, method=kind)
    if kind == "fwd_nested":
        return ForwardNested(fn, **kw)
    if kind == "fwd_over_rev":
        return jaxamp.Derivatives(fn, **kw, method="forward_over_reverse")
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
