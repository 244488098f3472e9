"""Where the derivatives of a ``dropin.grad`` program sit in float16's window, and start scales.

:func:`profile` evaluates the function promoted to float32 and reports per scaler key the
range of ``derivatives`` (the scaled derivatives the key's checks look at), ``hidden`` (the
float16/bfloat16 values that depend on the key's seed and feed its check) and ``keys`` (what
:func:`jaxamp._src.core.window.recommend` fits: those held in float16/bfloat16).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend.core import primitives as jp

from jaxamp._src.scaling.config import AmpConfig, check_flags
from jaxamp._src.core.marks import NONFINITE_VALUES, deriv_check_p, deriv_scale_p
from jaxamp._src.core.evaluate import Context, Recorder, evaluate, inputs, marks_in
from jaxamp._src.core.tracing import check_amp, state_config, traced
from jaxamp._src.core.interpreter import bind, custom_body, eval_jaxpr, holds, sub_jaxpr, sub_jaxprs
from jaxamp._src.core.rules import held_operands, rules_of
from jaxamp._src.core.window import (Profile, check_margin, is_low_precision, promote_eqn, promote_value, recommend,
                                     value_range)
from jaxamp._src.scaling.scaler import Scalers

__all__ = ["profile", "profile_traced", "init_scalers", "scalers_of", "keys_of", "scaler_keys"]


def _inline(eqn, vals):
    """Bind ``eqn``, with call, ``jax.checkpoint`` and custom-derivative bodies inlined (one flat
    program: a profile evaluates once, so rematerialization does not matter)."""
    body = sub_jaxpr(eqn) or custom_body(eqn)
    if body is not None:
        return eval_jaxpr(body.jaxpr, body.consts, vals, _inline)
    if eqn.primitive is jp.remat_p:
        return eval_jaxpr(eqn.params["jaxpr"], (), vals, _inline)
    return bind(eqn, vals)


def _key_sets(jaxpr: jcore.Jaxpr, ctx: Context, resolved) -> Dict[Any, frozenset]:
    """``{var: keys}``: the scaler keys whose seed ``var`` depends on and whose check it feeds."""
    after: Dict[Any, frozenset] = {}  # keys of the seeds a var depends on
    for eqn in jaxpr.eqns:
        if eqn.primitive is deriv_scale_p:
            keys = frozenset((ctx.key(*resolved[eqn]),))
        elif eqn.primitive is deriv_check_p:  # the identity on its first operand
            first = eqn.invars[0]
            keys = frozenset() if isinstance(first, jcore.Literal) else after.get(first, frozenset())
        else:
            reads = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
            keys = frozenset().union(*(after.get(v, frozenset()) for v in reads))
        after.update((v, keys) for v in eqn.outvars)
    before: Dict[Any, frozenset] = {}  # keys of the checks a var feeds
    for eqn in reversed(jaxpr.eqns):
        down = frozenset().union(*(before.get(v, frozenset()) for v in eqn.outvars))
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        if eqn.primitive is deriv_check_p:  # the scaled gradient feeds the check, the value does not
            ins = ins[:1]
            down = down | {ctx.key(*resolved[eqn])} if eqn.params["check"] else down
        for v in ins:
            before[v] = before.get(v, frozenset()) | down
    return {v: after[v] & before[v] for v in after if v in before and after[v] & before[v]}


class _Ranges(Recorder):
    """The recording mode of :func:`jaxamp._src.core.evaluate.evaluate` for a profile: every
    equation promoted to float32; the checked derivatives (``derivatives``; ``low`` where held
    in float16/bfloat16 and not under ``hidden`` already) and the float16/bfloat16 values that
    depend on a key's seed and feed its check (``hidden``) recorded per key."""

    def __init__(self, hidden_of: Dict[Any, frozenset]) -> None:
        self.hidden_of = hidden_of
        self.found: Dict[str, Dict[str, List[jax.Array]]] = {"derivatives": {}, "hidden": {}, "low": {}, "operands": {}}
        self.formats: Dict[str, str] = {}  # the format of each operand row

    def record(self, group: str, key: str, value) -> None:
        self.found[group].setdefault(key, []).append(jnp.ravel(jnp.asarray(value, jnp.float32)))

    def bind(self, eqn: jcore.JaxprEqn, invals: List[Any]) -> List[Any]:
        rule = rules_of(eqn.primitive).held_operands  # the matmul operands against their format's window
        for role, fmt, held in rule(*[promote_value(v) for v in invals], **eqn.params) if rule else ():
            self.formats[f"{role} {fmt}"] = fmt
            self.record("operands", f"{role} {fmt}", held)
        return promote_eqn(eqn, invals)

    def derivative(self, eqn: jcore.JaxprEqn, key: str, g: Any) -> None:
        self.record("derivatives", key, g)
        var = eqn.invars[0]
        held = () if isinstance(var, jcore.Literal) else self.hidden_of.get(var, ())
        if is_low_precision(getattr(var.aval, "dtype", None)) and key not in held:
            self.record("low", key, g)

    def outputs(self, eqn: jcore.JaxprEqn, outs: List[Any]) -> None:
        for var, out in zip(eqn.outvars, outs):
            if is_low_precision(getattr(var.aval, "dtype", None)):
                for key in self.hidden_of.get(var, ()):
                    self.record("hidden", key, out)


def profile(fun: Callable[..., Any], amp: Optional[AmpConfig] = None) -> Callable[..., Profile]:
    """The float16 range of every scaled derivative in ``fun``, per scaler key: :func:`jaxamp.scaled`
    in a recording mode, called as it is.

    Args:
      fun: a function taking derivatives with :func:`jaxamp.grad` and its siblings (not inside
        ``scan``/``while``/``cond`` bodies), or a :class:`jaxamp.Derivatives` engine.
      amp: as for :func:`jaxamp.scaled`.

    Returns:
      ``prof(state, *args, **kwargs) -> Profile`` with ``derivatives``, ``hidden`` and ``keys``
      per key (see the module docstring). ``state``: an :class:`~jaxamp.AmpState` (or an
      optimizer state holding one), whose config and scales are used; ``{key: f32[]}`` scales
      under ``amp``; or None: every key at scale 1 under ``amp`` (a profile before training).
      Empty when the derivative scalers are inactive.

    Example:
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> u = lambda p, x: jnp.tanh((p * x).astype(jnp.float16)).astype(jnp.float32)
      >>> losses = jax.vmap(jaxamp.grad(jaxamp.grad(u, 1), 1), (None, 0))
      >>> prof = jaxamp.profile(losses, jaxamp.AmpConfig())(None, 300.0, jnp.linspace(0.0, 0.01, 8))
      >>> sorted(prof.keys), jaxamp._src.core.window.recommend(prof).scales_log2
      (['1', '2'], {'1': 0, '2': -3})
    """
    if callable(getattr(fun, "marked_program", None)) and isinstance(getattr(fun, "amp", None), AmpConfig):
        fun, amp = fun.marked_program, fun.amp  # a jaxamp.Derivatives engine: its marked program
    if not callable(fun):
        raise TypeError(f"jaxamp.profile: `fun`={fun!r} must be callable or a jaxamp.Derivatives.")
    check_amp(amp, "jaxamp.profile")

    def prof(state: Any, *args, **kwargs) -> Profile:
        ctx_amp, scales = amp, None
        if state is not None:  # a state (or an optimizer state holding one) brings its config
            try:
                ctx_amp, scales = state_config(state, amp, "jaxamp.profile")
            except TypeError:
                raise TypeError(f"jaxamp.profile: the first argument `state`={state!r} must be None (every scale 1), a "
                                "mapping {key: f32[]} or an AmpState (or an optimizer state holding one: "
                                "jaxamp.optimizer). Fix: pass the state first, as to jaxamp.scaled: "
                                "jaxamp.profile(fun, amp)(None, params, batch).") from None
        closed, flat, _ = traced(fun, args, kwargs, ctx_amp, "jaxamp.profile")
        return profile_traced(closed, flat, ctx_amp, scales)

    return prof


def profile_traced(closed: jcore.ClosedJaxpr, flat, amp: Optional[AmpConfig],
                   scales: Optional[Mapping[str, Any]] = None) -> Profile:
    """:func:`profile` of a program traced by :func:`jaxamp._src.core.tracing.traced` at ``flat``."""
    ctx = Context({}, amp)
    if not (ctx.active or holds(closed.jaxpr, held_operands())):
        return Profile(derivatives={}, hidden={}, keys={})
    flat_jaxpr = jax.make_jaxpr(lambda *a: eval_jaxpr(closed.jaxpr, closed.consts, a, _inline))(*flat)
    for eqn in flat_jaxpr.jaxpr.eqns:
        if any(marks_in(j, ctx.holds) for j in sub_jaxprs(eqn)):
            raise NotImplementedError("jaxamp.profile: a jaxamp.grad inside a "
                                      f"`{eqn.primitive.name}` body is not profiled; profile "
                                      "the function the loop or branch calls (or start the "
                                      "scalers without a profile: jaxamp.init(loss, amp, "
                                      "from_profile=False)).")
    resolved = ctx.analyses(flat_jaxpr.jaxpr, inputs(flat_jaxpr.jaxpr)).resolved
    keys = ctx.keys(flat_jaxpr.jaxpr, inputs(flat_jaxpr.jaxpr))
    if unknown := sorted(k for k in (scales or {}) if k not in keys):
        raise KeyError(f"jaxamp.profile: `state` has scales for the key(s) {unknown}, which the program does not take "
                       f"(its keys: {[k for k in keys if k != NONFINITE_VALUES]}); is the first argument the state?")
    ctx.scales = {k: jnp.float32(1.0) for k in keys} | dict(scales or {})
    ctx.recorder = recorder = _Ranges(_key_sets(flat_jaxpr.jaxpr, ctx, resolved))
    consts = [promote_value(c) for c in flat_jaxpr.consts]
    evaluate(flat_jaxpr.jaxpr, consts, [promote_value(a) for a in flat], ctx, inputs(flat_jaxpr.jaxpr),
             literal=promote_value)
    found = recorder.found
    ranges = {g: {k: value_range(jnp.concatenate(v)) for k, v in found[g].items()}
              for g in ("derivatives", "hidden")}
    low = {k: value_range(jnp.concatenate(found["hidden"].get(k, []) + found["low"].get(k, [])))
           for k in dict.fromkeys([*found["hidden"], *found["low"]])}
    operands = {k: value_range(jnp.concatenate(v), dtype=recorder.formats[k]) for k, v in found["operands"].items()}
    if not ctx.active:  # derivative scaling off (plain FP8): the operands only
        return Profile(derivatives={}, hidden={}, keys={}, operands=operands)
    return Profile(derivatives=ranges["derivatives"], hidden=ranges["hidden"], keys=low, operands=operands)


def init_scalers(fun: Callable[..., Any], amp: Optional[AmpConfig] = None, *, from_profile: bool = True,
                 margin_log2: int = 2) -> Callable[..., Scalers]:
    """The derivative scalers of ``fun``'s ``dropin.grad`` calls, started from a profile.

    Args:
      fun: as for :func:`profile` (typically the function of the per-point losses).
      amp: the settings (None: ``AmpConfig()``).
      from_profile: start each key at the scale :func:`jaxamp._src.core.window.recommend` gives a
        profile at every scale 1; False: at ``amp``'s rules.
      margin_log2: powers of two kept free below 65504 (as ``recommend``).

    Returns:
      ``init(*args, **kwargs) -> Scalers`` on example arguments (initial parameters, a batch);
      only the start scales differ from ``amp``'s rules.

    Example:
      >>> import jax, jax.numpy as jnp, jaxamp
      >>> u = lambda w, x: (w.astype(jnp.float16) * jnp.sin(x.astype(jnp.float16))).astype(jnp.float32)
      >>> losses = jax.vmap(jaxamp.grad(jaxamp.grad(u, 1), 1), (None, 0))
      >>> scalers = init_scalers(losses, jaxamp.AmpConfig())(jnp.float32(2.0**15), jnp.linspace(0.5, 1.0, 8))
      >>> {k: float(s.scale) for k, s in scalers.items()}, scalers.rules["2"].max_scale
      ({'1': 0.5, '2': 0.5}, 1.0)
    """
    check_amp(amp, "jaxamp.init")
    check_flags("jaxamp.init", from_profile=from_profile)
    check_margin(margin_log2, "jaxamp.init")
    amp = AmpConfig() if amp is None else amp

    def init(*args, **kwargs) -> Scalers:
        closed, flat, _ = traced(fun, args, kwargs, amp, "jaxamp.init")
        return scalers_of(closed, flat, amp, from_profile=from_profile, margin_log2=margin_log2)

    return init


def scalers_of(closed: jcore.ClosedJaxpr, flat, amp: AmpConfig, *, from_profile: bool = True,
               margin_log2: int = 2) -> Scalers:
    """:func:`init_scalers` of a program traced by :func:`jaxamp._src.core.tracing.traced` at
    ``flat`` (the profile compiled once, the program not traced again)."""
    keys = keys_of(closed, amp)
    start = amp  # the config whose rules start the keys
    if from_profile and keys:
        prof = jax.jit(lambda arrays: profile_traced(closed, arrays, amp))(flat)
        rec = recommend(prof, margin_log2=margin_log2, default_max_scale_log2=amp.default_max_scale_log2)
        start = rec.apply(amp)
    return Scalers({k: start.derivative_scaler_for(k) for k in keys})


def keys_of(closed: jcore.ClosedJaxpr, amp: Optional[AmpConfig]) -> Tuple[str, ...]:
    """The scaler keys of a traced program's derivatives (``"nonfinite_values"`` left out)."""
    return tuple(k for k in Context({}, amp).keys(closed.jaxpr, inputs(closed.jaxpr)) if k != NONFINITE_VALUES)


def scaler_keys(fun: Callable[..., Any], amp: Optional[AmpConfig] = None) -> Callable[..., Tuple[str, ...]]:
    """``scaler_keys(fun, amp)(*args)``: the scaler keys of the derivatives ``fun`` takes, e.g.
    ``{k: amp.derivative_scaler_for(k).init() for k in scaler_keys(loss, amp)(params, batch)}``.
    """
    check_amp(amp)

    def keys(*args, **kwargs) -> Tuple[str, ...]:
        return keys_of(traced(fun, args, kwargs, amp, "jaxamp.init")[0], amp)

    return keys
