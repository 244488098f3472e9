"""The pieces of a mixed-precision train step (docs/algorithm.md, "Training step"): gradients
(:func:`loss_scaled_grad`), the apply-or-skip decision (:func:`check_step`) and the scaler updates
(:func:`update_scalers`). All branches are selects: no host synchronisation, one compilation.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple, TypeVar

import jax
import jax.numpy as jnp
import jmp

from jaxamp.marks import NONFINITE_VALUES
from jaxamp.scaler import DynamicScaler, Scalers, ScaleState

T = TypeVar("T")
Flags = Mapping[str, jax.Array]

class SkipReason(enum.IntEnum):
    """Why a step was skipped (``metrics["skip_reason"]``, ``AmpOptState.skip_reason``), an ``int``
    enum to compare with the ``i32`` arrays.

    Example:
      >>> from jaxamp.step import SkipReason
      >>> SkipReason(1).name
      'DERIVATIVE_OVERFLOW'
    """

    APPLIED = 0  # the update was applied
    DERIVATIVE_OVERFLOW = 1  # a derivative scaler key overflowed: that key backs off
    NONFINITE_GRADS = 2  # the weight gradients are non-finite: the loss scale backs off
    NONFINITE_VALUES = 3  # bad inputs or network outputs: no scaler moves


class ScaledGrads(NamedTuple):
    """What :func:`jaxamp.value_and_grad` returns as gradients: the weight gradients (loss scale
    divided out), the derivative flags and each key's headroom (``{key: f32[]}``), for
    :func:`jaxamp.optimizer` and :func:`jaxamp.apply_or_skip`."""

    grads: Any
    found_inf: Dict[str, jax.Array]
    headroom_log2: Dict[str, jax.Array] = {}

def loss_scaled_grad(fun: Callable[..., Tuple[jax.Array, Any]], argnums: Any,
                     loss_scale: Optional[jax.Array]) -> Callable[..., Tuple[Any, Tuple[jax.Array, Any]]]:  # fmt: skip
    """The gradients of ``fun``'s loss times ``loss_scale`` (float32), divided by it, as in
    :func:`jaxamp.value_and_grad`: float16 weight gradients that would underflow survive.

    Args:
      fun: ``fun(*args) -> (loss, aux)``.
      argnums: as ``jax.grad``.
      loss_scale: ``f32[]``, or None (loss scaling off: nothing multiplies).

    Returns:
      ``g(*args) -> (grads, (loss, aux))``, ``loss`` unscaled.
    """

    def g(*args: Any) -> Tuple[Any, Tuple[jax.Array, Any]]:
        s = None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)

        def scaled(*a: Any) -> Tuple[jax.Array, Tuple[jax.Array, Any]]:
            loss, aux = fun(*a)
            return (loss if s is None else loss.astype(jnp.float32) * s), (loss, aux)

        grads, out = jax.grad(scaled, argnums, has_aux=True)(*args)
        if s is None:
            return grads, out
        inv = jnp.float32(1.0) / s
        return jax.tree_util.tree_map(lambda x: x * inv.astype(x.dtype), grads), out

    return g


class StepCheck(NamedTuple):
    """The apply-or-skip decision of one step (a pytree of scalars; see :func:`check_step`)."""

    apply: jax.Array  # bool[]: the update is applied
    skip_reason: jax.Array  # i32[]: a SkipReason
    found_inf: Dict[str, jax.Array]  # {scaler key: bool[]}: a true overflow under that key
    nonfinite_values: jax.Array  # bool[]: bad values (inputs, network outputs) somewhere
    derivative_overflow: jax.Array  # bool[]: some derivative scaler key overflowed
    grads_finite: jax.Array  # bool[]: the unscaled weight gradients are finite

    def select(self, applied: T, skipped: T) -> T:
        """``applied`` where the step applies, else ``skipped``, leaf by leaf, for any pytrees of
        the same structure. A select, not a blend: inf/NaN in the unselected tree never leak.

        Example:
          >>> import jax.numpy as jnp, jaxamp
          >>> scalers = jaxamp.init(None, jaxamp.AmpConfig(dtype="float16"), keys=["2"])().derivative
          >>> check = jaxamp.step.check_step({"2": jnp.array(True)}, {"w": jnp.ones(2)}, scalers)
          >>> check.select({"w": jnp.full(2, jnp.nan)}, {"w": jnp.ones(2)})  # skipped: the old params
          {'w': Array([1., 1.], dtype=float32)}
        """
        return jmp.select_tree(self.apply, applied, skipped)


def check_step(found_inf: Flags, grads: Any, scalers: Mapping[str, Any], *, axis_name: Optional[Any] = None) -> StepCheck:
    """Decide whether a step applies, and why not.

    Precedence (docs/algorithm.md, "Training step"): bad values (``found_inf[NONFINITE_VALUES]``,
    which no scale cures) over a derivative overflow (which makes the gradients non-finite) over
    non-finite weight gradients.

    Args:
      found_inf: ``{key: bool[]}`` from the derivative engines, ``NONFINITE_VALUES`` included.
      grads: the unscaled weight gradients (any pytree).
      scalers: the derivative scalers (or any mapping with the same keys); a flag under any
        other key but ``NONFINITE_VALUES`` is an error.
      axis_name: inside ``pmap``/``shard_map``/``vmap``: OR the flags over this named axis.

    Returns:
      A :class:`StepCheck`.

    Example (flags as a derivative engine returns them: key ``"2"`` overflowed):
      >>> import jax.numpy as jnp, jaxamp
      >>> scalers = jaxamp.init(None, jaxamp.AmpConfig(dtype="float16"), keys=["1", "2"])().derivative
      >>> found_inf = {"1": jnp.array(False), "2": jnp.array(True), "nonfinite_values": jnp.array(False)}
      >>> check = jaxamp.step.check_step(found_inf, {"w": jnp.ones(2)}, scalers)
      >>> bool(check.apply), jaxamp.SkipReason(int(check.skip_reason)).name
      (False, 'DERIVATIVE_OVERFLOW')
    """
    unknown = sorted(k for k in found_inf if k not in scalers and k != NONFINITE_VALUES)
    if unknown:
        raise KeyError(
            f"check_step: found_inf has scaler key(s) {unknown} with no scaler (the scalers have "
            f"{sorted(scalers)}). Create the state with jaxamp.init(loss, amp)(*args) or TrainState.create(..., "
            "engines=[every engine the loss uses])."
        )
    flags = {k: jnp.asarray(found_inf.get(k, False), bool).reshape(()) for k in scalers}
    values = jnp.asarray(found_inf.get(NONFINITE_VALUES, False), bool).reshape(())
    finite = jmp.all_finite(grads)
    if axis_name is not None:
        reduce = lambda b: jax.lax.pmax(b.astype(jnp.int32), axis_name) > 0  # noqa: E731
        flags, values, finite = {k: reduce(v) for k, v in flags.items()}, reduce(values), ~reduce(~finite)
    overflow = jnp.stack(list(flags.values())).any() if flags else jnp.asarray(False)
    reason = jnp.where(values, int(SkipReason.NONFINITE_VALUES), jnp.where(overflow, int(SkipReason.DERIVATIVE_OVERFLOW),
                       jnp.where(finite, int(SkipReason.APPLIED), int(SkipReason.NONFINITE_GRADS))))
    return StepCheck(apply=reason == int(SkipReason.APPLIED), skip_reason=reason.astype(jnp.int32), found_inf=flags,
                     nonfinite_values=values, derivative_overflow=overflow, grads_finite=finite)


def update_scalers(
    check: StepCheck, scalers: Scalers, loss_scale: ScaleState, loss_rule: Optional[DynamicScaler]
) -> Tuple[Scalers, ScaleState]:
    """The scaler updates after a step (docs/algorithm.md, "Training step"): on bad values none
    moves; else every derivative scaler steps with its own flag, and unless a derivative
    overflowed the loss scaler steps with "gradients non-finite".

    Args:
      check: this step's :class:`StepCheck`. scalers: the derivative scalers.
      loss_scale, loss_rule: the loss scaler's state and rule (None: loss scaling off, no change).

    Returns:
      ``(scalers, loss_scale)`` after the step.

    Example (key ``"2"`` overflowed: it backs off, key ``"1"`` and the loss scale stay):
      >>> import jax.numpy as jnp, jaxamp
      >>> amp = jaxamp.AmpConfig(dtype="float16")
      >>> state = jaxamp.init(None, amp, keys=["1", "2"])()
      >>> scalers, loss_scale = state.derivative, state.loss
      >>> check = jaxamp.step.check_step({"2": jnp.array(True)}, {"w": jnp.ones(2)}, scalers)
      >>> scalers, loss_scale = jaxamp.step.update_scalers(check, scalers, loss_scale, amp.make_loss_scaler())
      >>> {k: float(v) for k, v in scalers.scales.items()}, float(loss_scale.scale)
      ({'1': 1.0, '2': 0.5}, 65536.0)
    """
    if not isinstance(scalers, Scalers):
        raise TypeError(f"update_scalers: `scalers` must be a jaxamp.scaler.Scalers (jaxamp.init pairs each "
                        f"key with its rule), got {type(scalers).__name__}.")
    frozen = check.nonfinite_values
    scalers = jmp.select_tree(frozen, scalers, scalers.update(check.found_inf))
    if loss_rule is not None:
        stepped = loss_rule.update(loss_scale, ~check.grads_finite)
        loss_scale = jmp.select_tree(frozen | check.derivative_overflow, loss_scale, stepped)
    return scalers, loss_scale
