"""A user's train step in three lines: :func:`value_and_grad`, :func:`apply_or_skip`, :func:`optimizer`.

docs/algorithm.md, "Training step", over one :class:`~jaxamp.AmpState`: :func:`value_and_grad`
scales every :func:`jaxamp.grad` in the loss and the loss itself; :func:`apply_or_skip` applies or
skips an update and advances every scaler; :func:`optimizer` does that inside an optax
transformation (the AMP state lives in its state). Every decision is a select.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union

import jax
import jax.numpy as jnp
import optax

from jaxamp.config import check_flags
from jaxamp.dropin.grad import check_fun
from jaxamp.dropin.scaled import scaled
from jaxamp.state import AmpState, find
from jaxamp.step import ScaledGrads, StepCheck, check_step, loss_scaled_grad, update_scalers

__all__ = ["value_and_grad", "apply_or_skip", "optimizer", "AmpOptState", "advance"]

T = TypeVar("T")


def advance(check: StepCheck, state: AmpState) -> AmpState:
    """Every scaler of ``state`` advanced after the step ``check`` decided (``update_scalers``)."""
    derivative, loss = update_scalers(check, state.derivative, state.loss, state.loss_rule)
    return state.replace(derivative=derivative, loss=loss)


def _loss_of(out: Any, has_aux: bool, fun: Callable) -> Tuple[jax.Array, Any]:
    def what(x: Any) -> str:
        return f"an array of shape {jnp.shape(x)}" if hasattr(x, "shape") else type(x).__name__

    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f"jaxamp.value_and_grad: `fun`={fun!r} with has_aux=True must return (loss, aux), got {what(out)}.")
    loss, aux = out if has_aux else (out, None)
    if not (hasattr(loss, "shape") and jnp.shape(loss) == () and jnp.issubdtype(jnp.result_type(loss), jnp.floating)):
        raise TypeError(f"jaxamp.value_and_grad: `fun`={fun!r} must return a float scalar loss (or (loss, aux) with "
                        f"has_aux=True), got {what(loss)}; for a vector of losses use jaxamp.scaled(jax.jacrev(fun)).")
    return loss, aux


def value_and_grad(fun: Callable[..., Any], argnums: Union[int, Sequence[int]] = 0, has_aux: bool = False, *,
                   merge: bool = True) -> Callable[..., Tuple[Any, ScaledGrads]]:  # fmt: skip
    """``jax.value_and_grad`` with the derivative scalers and the loss scaler of an AMP state.

    Args:
      fun: ``fun(params, *args) -> loss`` (a float scalar), or ``(loss, aux)`` with
        ``has_aux=True``; its derivatives written with :func:`jaxamp.grad` and its siblings.
      argnums, has_aux: as ``jax.value_and_grad``.
      merge: as :func:`jaxamp.scaled`.

    Returns:
      ``vg(state, *args, **kwargs) -> (value, grads)``: ``state`` an :class:`~jaxamp.AmpState`
      or an optimizer state holding one; ``value`` unscaled; ``grads`` a
      :class:`~jaxamp.step.ScaledGrads`, for :func:`apply_or_skip` or :func:`optimizer`.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> loss = lambda p, x: jaxamp.grad(lambda p, x: jnp.sin(p * x), 1)(p, x) ** 2
      >>> state = jaxamp.init(loss, jaxamp.AmpConfig())(2.0, 0.5)
      >>> value, grads = jaxamp.value_and_grad(loss)(state, 2.0, 0.5)
      >>> sorted(grads.found_inf)
      ['1', 'nonfinite_values']
    """
    check_fun("jaxamp.value_and_grad", fun, None)
    check_flags("jaxamp.value_and_grad", has_aux=has_aux, merge=merge)

    def vg(state: Any, *args: Any, **kwargs: Any) -> Tuple[Any, ScaledGrads]:
        amp_state = find(state, "jaxamp.value_and_grad")
        marked = scaled(fun, amp_state.amp, merge=merge, headroom=True)
        # static: with loss scaling off nothing multiplies
        loss_scale = None if amp_state.loss_rule is None else amp_state.loss_scale

        def loss_of(*a):
            out, found, room = marked(amp_state.scales, *a, **kwargs)
            loss, aux = _loss_of(out, has_aux, fun)
            return loss, (aux, found, room)

        grads, (loss, (aux, found, room)) = loss_scaled_grad(loss_of, argnums, loss_scale)(*args)
        return ((loss, aux) if has_aux else loss), ScaledGrads(grads, found, room)

    return vg


def _decide(state: AmpState, grads: Union[ScaledGrads, Mapping[str, jax.Array]], axis_name) -> StepCheck:
    if not isinstance(grads, (ScaledGrads, Mapping)):  # a Mapping: flags only, e.g. of jaxamp.scaled(jax.jacrev(losses))
        raise TypeError(f"jaxamp.apply_or_skip: `grads` must be the ScaledGrads of jaxamp.value_and_grad or the "
                        f"found_inf flags of jaxamp.scaled, got {type(grads).__name__}.")  # fmt: skip
    flags, weights = (grads.found_inf, grads.grads) if isinstance(grads, ScaledGrads) else (grads, ())
    return check_step(flags, weights, state.derivative, axis_name=axis_name)


def apply_or_skip(state: Any, grads: Union[ScaledGrads, Mapping[str, jax.Array]], applied: T, skipped: T, *,
                  axis_name: Optional[Any] = None) -> Tuple[T, AmpState]:  # fmt: skip
    """Apply or skip an update of any pytrees, and advance every scaler.

    Args:
      state: the :class:`~jaxamp.AmpState` the step ran with (or an optimizer state holding one).
      grads: the :class:`~jaxamp.step.ScaledGrads` of :func:`value_and_grad`, or the
        ``found_inf`` flags of :func:`jaxamp.scaled` (then the loss scaler does not move).
      applied, skipped: pytrees of the same structure: the new values and those kept on a skip.
      axis_name: inside ``pmap``/``shard_map``: OR the flags over this axis.

    Returns:
      ``(applied or skipped, new state)``, a select: inf/NaN of the unselected tree never leak.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> state = jaxamp.init(None, jaxamp.AmpConfig())()
      >>> grads = jaxamp.step.ScaledGrads(jnp.array([jnp.inf]), {})
      >>> params, state = jaxamp.apply_or_skip(state, grads, jnp.array([jnp.nan]), jnp.array([1.0]))
      >>> params, float(state.loss_scale)
      (Array([1.], dtype=float32), 32768.0)
    """
    state = find(state, "jaxamp.apply_or_skip")
    check = _decide(state, grads, axis_name)
    new = advance(check, state)  # flags only: the loss scaler stays
    return check.select(applied, skipped), new if isinstance(grads, ScaledGrads) else new.replace(loss=state.loss)


class AmpOptState(NamedTuple):
    """The state of :func:`optimizer`: the inner optimizer's, the AMP state and the last step's
    :class:`~jaxamp.SkipReason` (``i32[]``, 0 when applied)."""

    inner: Any
    amp: AmpState
    skip_reason: jax.Array


def optimizer(inner: optax.GradientTransformation, state: AmpState, *,
              axis_name: Optional[Any] = None) -> optax.GradientTransformationExtraArgs:  # fmt: skip
    """Wrap any optax optimizer: skip the update on overflow and advance every scaler.

    Unlike ``optax.apply_if_finite``, a skipped step is always a zero update, inner state unchanged.

    Args:
      inner: any optax ``GradientTransformation``.
      state: the initial :class:`~jaxamp.AmpState` (from :func:`jaxamp.init`).
      axis_name: inside ``pmap``/``shard_map``: OR the flags over this axis.

    Returns:
      A ``GradientTransformationExtraArgs`` whose ``update`` takes the ``ScaledGrads`` of
      :func:`value_and_grad` (or plain gradients) and whose state is an :class:`AmpOptState`
      (its ``amp`` is what :func:`value_and_grad` reads).

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.optimizer(optax.adam(1e-3), jaxamp.init(None, jaxamp.AmpConfig())())
      >>> opt_state = tx.init({"w": jnp.zeros(3)})
      >>> float(opt_state.amp.loss_scale)
      65536.0
    """
    if not isinstance(state, AmpState):
        raise TypeError(f"jaxamp.optimizer: `state`={state!r} must be a jaxamp.AmpState (from jaxamp.init).")
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(f"jaxamp.optimizer: `inner`={inner!r} must be an optax GradientTransformation.")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> AmpOptState:
        return AmpOptState(inner.init(params), state, jnp.asarray(0, jnp.int32))

    def update_fn(updates: Any, opt_state: AmpOptState, params: Any = None, **extra: Any):
        grads = updates if isinstance(updates, ScaledGrads) else ScaledGrads(updates, {})
        check = _decide(opt_state.amp, grads, axis_name)
        new_updates, new_inner = inner.update(grads.grads, opt_state.inner, params, **extra)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, new_updates)
        new_updates, new_inner = check.select((new_updates, new_inner), (zeros, opt_state.inner))
        return new_updates, AmpOptState(new_inner, advance(check, opt_state.amp), check.skip_reason)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
