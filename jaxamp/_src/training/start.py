"""``jaxamp.init``, the one constructor of an :class:`~jaxamp.AmpState`: a program's scaler keys
and their start scales from a float32 profile (:mod:`jaxamp._src.core.profile`), its autocast
policies checked against the config, its float16 derivatives that no scaler guards warned of
(:mod:`jaxamp._src.training.coverage`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax.numpy as jnp

from jaxamp._src.core import policy
from jaxamp._src.core.marks import UnscaledDerivativeWarning
from jaxamp._src.scaling.config import AmpConfig, check_flags
from jaxamp._src.core.profile import scalers_of
from jaxamp._src.core.tracing import traced
from jaxamp._src.scaling.scaler import Scalers, ScaleState
from jaxamp._src.scaling.state import AmpState
from jaxamp._src.core.window import check_margin
from jaxamp._src.training.coverage import Unscaled, unscaled_derivatives

__all__ = ["init", "UnscaledDerivativeWarning"]




def init(fun: Optional[Callable[..., Any]], amp: Optional[AmpConfig] = None, *, keys: Sequence[str] = (),
         from_profile: bool = True, margin_log2: int = 2) -> Callable[..., AmpState]:
    """The :class:`AmpState` of a program written with :func:`jaxamp.grad` and its siblings.

    Args:
      fun: the function whose derivatives the scalers guard, called on example arguments to find
        its scaler keys; None: no derivative scalers but ``keys``'.
      amp: the settings (None: ``AmpConfig()``).
      from_profile: start each derivative scaler where a float32 profile of ``fun`` at scale 1
        puts it (:func:`jaxamp._src.core.window.recommend`); False: at the configured ``init_scale``.
      margin_log2: powers of two kept free below 65504 when starting from the profile.
      keys: more scaler keys, started at their configured rule (e.g. an engine's ``scaler_keys``).

    Returns:
      ``init_state(*args, **kwargs) -> AmpState``, called on example arguments as for ``fun``.
      It traces ``fun`` (:func:`jaxamp._src.core.tracing.traced`) and raises a
      :class:`~jaxamp.ConfigError` if an ``autocast`` in ``fun`` runs under another ``enabled`` /
      ``dtype`` / ``derivative_scaling``. While
      derivative scaling is on it warns (:class:`UnscaledDerivativeWarning`) naming each
      derivative ``fun`` takes in float16 that no scaler guards, by order, mode and the function
      it differentiates, beside the scaled ones or alone: a network cast to float16 by hand (or
      a Flax ``dtype=jnp.float16``) instead of :func:`jaxamp.autocast`, an ``autocast`` network
      differentiated along an array it holds as a parameter (captured, or in
      ``params_argnums``), a ``jax.grad`` through ``autocast`` under per-term keys
      (:mod:`jaxamp._src.training.coverage`, which also says what it cannot see).

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> u = lambda p, x: jnp.sin(p * x)
      >>> loss = lambda p, x: jaxamp.grad(jaxamp.grad(u, 1), 1)(p, x) ** 2
      >>> state = jaxamp.init(loss, jaxamp.AmpConfig(), from_profile=False)(1.0, 0.5)
      >>> sorted(state.scales)
      ['1', '2']
    """
    amp = AmpConfig() if amp is None else amp
    if not isinstance(amp, AmpConfig):
        raise TypeError(f"jaxamp.init: `amp`={amp!r} must be an AmpConfig or None; build one with "
                        "AmpConfig(...), AmpConfig(**config.amp) or AmpConfig.from_dict(cfg).")
    if fun is not None and not callable(fun):
        raise TypeError(f"jaxamp.init: `fun`={fun!r} must be callable (the loss whose derivatives are scaled) or "
                        "None; pass the function itself and call the result on example arguments: "
                        "jaxamp.init(loss, amp)(params, batch).")
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"jaxamp.init: `keys`={keys!r} must be a list of scaler keys (strings).")
    check_flags("jaxamp.init", from_profile=from_profile)
    check_margin(margin_log2, "jaxamp.init")  # here, not after tracing and profiling the loss

    def init_state(*args, **kwargs) -> AmpState:
        found = Scalers({})  # the keys of `fun` (from its profile), then those of `keys` it lacks
        if fun is not None:
            # traced once: the keys and the profile read the program, the coverage check JAX's trace of it
            program, flat, first = _trace(fun, args, kwargs, amp)
            if amp.scaler_enabled:
                found = scalers_of(program, flat, amp, from_profile=from_profile, margin_log2=margin_log2)
                _warn_unscaled(fun, unscaled_derivatives(first), found, program)
        more = {k: amp.derivative_scaler_for(k) for k in keys if k not in found} if amp.scaler_enabled else {}
        derivative = Scalers({**found.rules, **more}, {**found, **{k: r.init() for k, r in more.items()}})
        rule = amp.make_loss_scaler()
        off = ScaleState(jnp.asarray(1.0, jnp.float32), jnp.asarray(0, jnp.int32))
        return AmpState(amp, derivative, off if rule is None else rule.init(), rule)

    return init_state


def _describe(fun: Callable) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__name__


def _trace(fun: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any], amp: AmpConfig) -> Any:
    """``fun``'s program and array arguments (:func:`jaxamp._src.core.tracing.traced`: ``amp``
    active, its autocast policies checked); called with none, a failure names the fix."""
    try:
        closed, flat, _, first = traced(fun, args, kwargs, amp, "jaxamp.init", "the `amp` given to jaxamp.init",
                                        raw=True)
        return closed, flat, first
    except TypeError as e:
        if args or kwargs:
            raise
        raise TypeError(f"jaxamp.init: `fun`={_describe(fun)} failed on no arguments ({e}). jaxamp.init(fun, amp) "
                        "returns a builder: call it on example arguments as for fun, e.g. "
                        "jaxamp.init(loss, amp)(params, batch).") from None


def _warn_unscaled(fun: Callable, unscaled: Sequence[Unscaled], found: Scalers, program: Any) -> None:
    """Float16 derivatives no scaler guards, each named; or a derivative through a float16
    ``autocast`` network with no scaler at all (a form the analysis does not name)."""
    fix = ("Fix: place each such network with jaxamp.autocast(fn, amp) (not a cast to float16 by hand or a Flax "
           "dtype=jnp.float16), with the differentiated input an argument of it, not a captured array or one named "
           "in params_argnums; or take the derivative with jaxamp.grad / jaxamp.jacrev / jaxamp.jacfwd / "
           "jaxamp.hessian (under per-term keys, jaxamp.grad(..., of=, wrt=)); or pass "
           "AmpConfig(derivative_scaling=False) to both autocast and jaxamp.init for loss scaling only.")
    if unscaled:
        beside = f"beside the scaled ones (keys {sorted(found)})" if found else "and no scaled one"
        items = "; ".join(u.describe() for u in unscaled)
        warnings.warn(
            f"jaxamp.init: `fun`={_describe(fun)} takes float16 derivatives that no scaler guards, {beside}: "
            f"{items}. They run in float16 unscaled and unchecked (they may overflow: NaN losses, skipped "
            f"steps, with no scaler to back off). {fix}", UnscaledDerivativeWarning, stacklevel=3)
    elif not found and policy.derivative_taken(program):
        nets = ", ".join(f"autocast({p.fn})" for p in policy.policies_in(program))
        warnings.warn(
            f"jaxamp.init: `fun`={_describe(fun)} differentiates {nets}, which runs in float16, but no "
            f"derivative of it is scaled, so the state has no derivative scaler. {fix}",
            UnscaledDerivativeWarning, stacklevel=3)
