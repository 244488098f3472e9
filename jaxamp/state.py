"""`AmpState`: every scaler of a run in one pytree (rules static), and :func:`init`, the one way
to create it. Without derivative scaling it has no derivative scalers; without loss scaling its
loss scale stays 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from jaxamp.config import AmpConfig, check_flags
from jaxamp.scaler import DynamicScaler, Scalers, ScaleState

__all__ = ["AmpState", "init", "find"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(eq=False)
class AmpState:
    """The scalers of a run: derivative scalers per key and the loss scaler, with their rules.

    Create it with :func:`init`. Attributes: ``amp``, the :class:`~jaxamp.AmpConfig` (static);
    ``derivative``, a :class:`~jaxamp.scaler.Scalers`; ``loss``, the loss scaler's ``ScaleState``
    (scale 1 when loss scaling is off); ``loss_rule``, its ``DynamicScaler`` or None (static).

    Example:
      >>> import jaxamp
      >>> state = jaxamp.init(None, jaxamp.AmpConfig(enabled=False))()
      >>> state.scales, float(state.loss_scale)
      ({}, 1.0)
    """

    amp: AmpConfig = dataclasses.field(metadata=dict(static=True))
    derivative: Scalers
    loss: ScaleState
    loss_rule: Optional[DynamicScaler] = dataclasses.field(metadata=dict(static=True))

    @property
    def scales(self) -> Dict[str, jax.Array]:
        """``{key: f32[]}``: the current derivative scales (empty when scaling is off)."""
        return self.derivative.scales

    @property
    def loss_scale(self) -> jax.Array:
        """``f32[]``: the current loss scale (1 when loss scaling is off)."""
        return self.loss.scale

    def replace(self, *, derivative: Optional[Scalers] = None, loss: Optional[ScaleState] = None) -> "AmpState":
        """A copy with new scaler states (the rules stay)."""
        return AmpState(self.amp, self.derivative if derivative is None else derivative,
                        self.loss if loss is None else loss, self.loss_rule)  # fmt: skip

    def __repr__(self) -> str:
        return f"AmpState(scales={self.scales!r}, loss_scale={self.loss_scale!r})"


def init(fun: Optional[Callable[..., Any]], amp: Optional[AmpConfig] = None, *, keys: Sequence[str] = (),
         from_profile: bool = True, margin_log2: int = 2) -> Callable[..., AmpState]:  # fmt: skip
    """The :class:`AmpState` of a program written with :func:`jaxamp.grad` and its siblings.

    Args:
      fun: the function whose derivatives the scalers guard, called on example arguments to find
        its scaler keys; None: no derivative scalers but ``keys``'.
      amp: the settings (None: ``AmpConfig()``).
      from_profile: start each derivative scaler where a float32 profile of ``fun`` at scale 1
        puts it (:func:`jaxamp.window.recommend`); False: at the configured ``init_scale``.
      margin_log2: powers of two kept free below 65504 when starting from the profile.
      keys: more scaler keys, started at their configured rule (e.g. an engine's ``scaler_keys``).

    Returns:
      ``init_state(*args, **kwargs) -> AmpState``, called on example arguments as for ``fun``.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> u = lambda p, x: jnp.sin(p * x)
      >>> loss = lambda p, x: jaxamp.grad(jaxamp.grad(u, 1), 1)(p, x) ** 2
      >>> state = jaxamp.init(loss, jaxamp.AmpConfig(), from_profile=False)(1.0, 0.5)
      >>> sorted(state.scales)
      ['1', '2']
    """
    from jaxamp.dropin.ranges import init_scalers  # the profile lives with the drop-in interpreter

    amp = AmpConfig() if amp is None else amp
    if not isinstance(amp, AmpConfig):
        raise TypeError(f"jaxamp.init: `amp`={amp!r} must be an AmpConfig or None.")
    if fun is not None and not callable(fun):
        raise TypeError(f"jaxamp.init: `fun`={fun!r} must be callable (the loss whose derivatives are scaled) or None.")
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"jaxamp.init: `keys`={keys!r} must be a list of scaler keys (strings).")
    check_flags("jaxamp.init", from_profile=from_profile)

    def init_state(*args, **kwargs) -> AmpState:
        found = Scalers({})  # the keys of `fun` (from its profile), then those of `keys` it lacks
        if fun is not None and amp.scaler_enabled:
            found = init_scalers(fun, amp, from_profile=from_profile, margin_log2=margin_log2)(*args, **kwargs)
        more = {k: amp.derivative_scaler_for(k) for k in keys if k not in found} if amp.scaler_enabled else {}
        derivative = Scalers({**found.rules, **more}, {**found, **{k: r.init() for k, r in more.items()}})
        rule = amp.make_loss_scaler()
        off = ScaleState(jnp.asarray(1.0, jnp.float32), jnp.asarray(0, jnp.int32))
        return AmpState(amp, derivative, off if rule is None else rule.init(), rule)

    return init_state


def find(tree: Any, caller: str) -> AmpState:
    """The one :class:`AmpState` in ``tree`` (an AmpState, or an optimizer state holding one)."""
    if isinstance(tree, AmpState):
        return tree
    found: Tuple[AmpState, ...] = tuple(x for x in jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, AmpState)) if isinstance(x, AmpState))  # fmt: skip
    if len(found) != 1:
        raise TypeError(
            f"{caller}: the first argument (`state`, or `scales` for jaxamp.scaled) must be a jaxamp.AmpState "
            f"(from jaxamp.init) or an optimizer state holding exactly one (from jaxamp.optimizer), or for "
            f"jaxamp.scaled a mapping {{key: scale}}; got {type(tree).__name__} holding {len(found)} AmpState(s)."
        )
    return found[0]
