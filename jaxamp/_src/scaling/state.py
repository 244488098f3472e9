"""`AmpState`: every scaler of a run in one pytree (rules static); :func:`jaxamp.init` is the one
way to create it. Without derivative scaling it has no derivative scalers; without loss scaling
its loss scale stays 1. :func:`find` locates it in an optimizer state.

States pickle and deep-copy; with flax installed, ``flax.serialization`` (``to_state_dict``,
``to_bytes`` / ``from_bytes`` into a fresh state of the same config) takes them too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

import jax

from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.scaling.scaler import DynamicScaler, Scalers, ScaleState

__all__ = ["AmpState", "find"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(eq=False)
class AmpState:
    """The scalers of a run: derivative scalers per key and the loss scaler, with their rules.

    Create it with :func:`init`. Attributes: ``amp``, the :class:`~jaxamp.AmpConfig` (static);
    ``derivative``, a :class:`~jaxamp._src.scaling.scaler.Scalers`; ``loss``, the loss scaler's ``ScaleState``
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
        derivative = self.derivative if derivative is None else derivative
        return AmpState(self.amp, derivative, self.loss if loss is None else loss, self.loss_rule)

    def __repr__(self) -> str:
        return f"AmpState(scales={self.scales!r}, loss_scale={self.loss_scale!r})"


def find(tree: Any, caller: str) -> AmpState:
    """The one :class:`AmpState` in ``tree`` (an AmpState, or an optimizer state holding one)."""
    if isinstance(tree, AmpState):
        return tree
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, AmpState))
    found: Tuple[AmpState, ...] = tuple(x for x in leaves if isinstance(x, AmpState))
    if len(found) != 1:
        # The likely slips: the state forgotten (the parameters come first), a plain optax state.
        hint = (" Fix: pass the state first, e.g. value_and_grad(loss)(opt_state, params, batch)"
                " with opt_state from jaxamp.optimizer(tx, amp_state=jaxamp.init(loss, amp)(params, batch))"
                ".init(params).")
        raise TypeError(
            f"{caller}: the first argument (`state`, or `scales` for jaxamp.scaled) must be a jaxamp.AmpState "
            f"(from jaxamp.init) or an optimizer state holding exactly one (from jaxamp.optimizer), or for "
            f"jaxamp.scaled a mapping {{key: scale}}; got {type(tree).__name__} holding {len(found)} AmpState(s)."
            + (hint if not found else "")
        )
    return found[0]


def _register_flax(serialization: Any) -> None:
    """``flax.serialization`` handlers for :class:`Scalers` (``{key: {scale, growth_tracker}}``) and
    :class:`AmpState` (``{derivative, loss}``); the rules and the config stay the target's."""

    def scalers_to(scalers: Scalers) -> Dict[str, Any]:
        return {k: serialization.to_state_dict(s) for k, s in scalers.items()}

    def scalers_from(target: Scalers, state: Mapping[str, Any]) -> Scalers:
        if set(state) != set(target):
            raise ValueError(f"jaxamp: the saved derivative scalers have keys {sorted(state)}; the target state has "
                             f"{sorted(target)}. Restore into jaxamp.init(...) of the config and loss that saved it.")
        return Scalers(target.rules, {k: serialization.from_state_dict(target[k], state[k], name=k) for k in target})

    def amp_state_to(amp_state: AmpState) -> Dict[str, Any]:
        return {"derivative": scalers_to(amp_state.derivative), "loss": serialization.to_state_dict(amp_state.loss)}

    def amp_state_from(target: AmpState, state: Mapping[str, Any]) -> AmpState:
        missing = sorted({"derivative", "loss"} - set(state))
        if missing:
            raise ValueError(f"jaxamp: a saved AmpState lacks {missing}; it holds {sorted(state)}.")
        derivative = serialization.from_state_dict(target.derivative, state["derivative"], name="derivative")
        return target.replace(derivative=derivative,
                              loss=serialization.from_state_dict(target.loss, state["loss"], name="loss"))

    serialization.register_serialization_state(Scalers, scalers_to, scalers_from, override=True)
    serialization.register_serialization_state(AmpState, amp_state_to, amp_state_from, override=True)


try:  # the scaling state does not need flax; where it is installed, its serialization takes the state
    from flax import serialization as _flax_serialization
except ImportError:
    _flax_serialization = None
if _flax_serialization is not None:
    _register_flax(_flax_serialization)
