"""A user's train step in three lines: :func:`value_and_grad`, :func:`optimizer`, :func:`apply_or_skip`.

docs/algorithm.md, "Training step", over one :class:`~jaxamp.AmpState`: :func:`value_and_grad` scales every
:func:`jaxamp.grad` in the loss and the loss itself; :func:`optimizer` is an optax ``GradientTransformationExtraArgs``
that applies or skips the update and advances every scaler (the AMP state lives in its state, an
:class:`AmpOptState`); :func:`apply_or_skip` does the same for any pytrees. Every decision is a select.

The flags travel inside the gradients (a :class:`~jaxamp.step.ScaledGrads`), not as an optax extra argument, so
the user's step stays optax's own (``optimizer.update(grads, opt_state, params)``, Flax's ``apply_gradients``):
float leaves, 0 clean and +inf set, beside gradients zeroed when one is set (:mod:`jaxamp.step`), they survive a
clip before the optimizer, ``lax.pmean``/``psum`` (a global OR) and any elementwise transformation.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar, Union

import jax
import jax.numpy as jnp
import optax

from jaxamp._src.scaling.config import check_flags
from jaxamp._src.core.checks import check_fun
from jaxamp._src.core.scaled import scaled
from jaxamp._src.core.modules import filter_grad, unfiltered
from jaxamp._src.scaling.state import AmpState, find
from jaxamp._src.training.monitor import report_stall
from jaxamp._src.training.flags import encode_flag, flag_set, zeroed_when
from jaxamp._src.training.step import (AmpOptState, ScaledGrads, StepCheck, check_like_params, check_step, find_opt_state,
                                       loss_scaled_grad, update_scalers, with_opt_state)

__all__ = ["value_and_grad", "apply_or_skip", "optimizer", "AmpOptState", "AmpOptimizer", "advance", "with_amp_state",
           "replace_amp", "step_state"]

T = TypeVar("T")
ON_STALL = ("warn", "raise", None)


def with_amp_state(opt_state: Any, amp_state: AmpState) -> Any:
    """``opt_state`` (any tree holding one :class:`AmpOptState`) with its AMP state set: the
    one-liner for an optimizer built before the loss existed (``jaxamp.optimizer(inner)``).

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.optimizer(optax.adam(1e-3)))
      >>> opt_state = tx.init({"w": jnp.zeros(3)})  # no AMP state yet
      >>> opt_state = jaxamp.step.with_amp_state(opt_state, jaxamp.init(None, jaxamp.AmpConfig())())
      >>> float(jaxamp._src.training.optim.find_opt_state(opt_state).amp.loss_scale)
      65536.0
    """
    if not isinstance(amp_state, AmpState):
        raise TypeError(f"jaxamp.step.with_amp_state: `amp_state`={amp_state!r} must be a jaxamp.AmpState "
                        "(from jaxamp.init(loss, amp)(params, batch)).")
    if find_opt_state(opt_state) is None:
        raise TypeError(f"jaxamp.step.with_amp_state: `opt_state` (a {type(opt_state).__name__}) must hold exactly "
                        "one AmpOptState: the state of jaxamp.optimizer(...).init(params).")
    is_amp = lambda x: isinstance(x, AmpOptState)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: x._replace(amp=amp_state) if is_amp(x) else x, opt_state, is_leaf=is_amp)


def locate(state: Any, caller: str) -> Tuple[AmpState, str]:
    """The AMP state the step runs with, and ``"optimizer"`` or ``"amp_state"``: where it came from."""
    opt = find_opt_state(state) if not isinstance(state, AmpState) else None
    if opt is not None and opt.amp is None:
        raise TypeError(f"{caller}: the optimizer's state has no AmpState yet (built by jaxamp.optimizer(inner) "
                        "without one); set it once: opt_state = jaxamp.step.with_amp_state(opt_state, "
                        "jaxamp.init(loss, amp)(params, batch)), or build jaxamp.optimizer(inner, amp_state=amp_state).")
    return find(state, caller), ("optimizer" if opt is not None else "amp_state")


def advance(check: StepCheck, state: AmpState) -> AmpState:
    """Every scaler of ``state`` advanced after the step ``check`` decided (``update_scalers``)."""
    derivative, loss = update_scalers(state.derivative, state.loss, state.loss_rule, check)
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
                   merge: bool = True, headroom: bool = False) -> Callable[..., Tuple[Any, ScaledGrads]]:  # fmt: skip
    """``jax.value_and_grad`` with the derivative scalers and the loss scaler of an AMP state.

    Args:
      fun: ``fun(params, *args) -> loss`` (a float scalar), or ``(loss, aux)`` with
        ``has_aux=True``; its derivatives written with :func:`jaxamp.grad` and its siblings.
      argnums, has_aux: as ``jax.value_and_grad``; Equinox / NNX modules as ``eqx.filter_value_and_grad`` does.
      merge: as :func:`jaxamp.scaled`.
      headroom: also return each key's headroom (``grads.headroom_log2``); off by default, as
        its values would count in a global norm of the gradients (e.g. a clip before the optimizer).

    Returns:
      ``vg(state, *args, **kwargs) -> (value, grads)``: ``state`` the state of
      :func:`optimizer` (or any optimizer state holding it), or a bare :class:`~jaxamp.AmpState`
      for :func:`apply_or_skip`; ``value`` unscaled; ``grads`` a :class:`~jaxamp.step.ScaledGrads`.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> loss = lambda p, x: jaxamp.grad(lambda p, x: jnp.sin(p * x), 1)(p, x) ** 2
      >>> state = jaxamp.init(loss, jaxamp.AmpConfig())(2.0, 0.5)
      >>> value, grads = jaxamp.value_and_grad(loss)(state, 2.0, 0.5)
      >>> sorted(grads.found_inf)
      ['1', 'nonfinite_values']
    """
    check_fun("jaxamp.value_and_grad", fun, None)
    check_flags("jaxamp.value_and_grad", has_aux=has_aux, merge=merge, headroom=headroom)

    def vg(state: Any, *args: Any, **kwargs: Any) -> Tuple[Any, ScaledGrads]:
        amp_state, source = locate(state, "jaxamp.value_and_grad")
        marked = scaled(fun, amp_state.amp, merge=merge, headroom=True)
        # static: with loss scaling off nothing multiplies
        loss_scale = None if amp_state.loss_rule is None else amp_state.loss_scale

        def loss_of(*a):
            out, found, room = marked(amp_state.scales, *a, **kwargs)
            loss, aux = _loss_of(out, has_aux, fun)
            return loss, (aux, found, room)

        held = amp_state.amp.tensor_scaling  # float16 cotangents widened: multiplied as float16 (no amax)
        grads, (loss, (aux, found, room)) = filter_grad(loss_scaled_grad, loss_of, argnums, loss_scale, held)(*args)
        if amp_state.amp.compute_dtype != jnp.float32:  # AMP off: the user's program as written
            # zeroed when a flag is set: a global norm downstream stays finite and cannot poison clean flags
            grads = zeroed_when([flag_set(v) for v in found.values()], grads)
        out = ScaledGrads(grads, {k: encode_flag(v) for k, v in found.items()}, room if headroom else {},
                          source=source)  # fmt: skip
        return ((loss, aux) if has_aux else loss), out

    return vg


def _decide(state: AmpState, grads: Any, axis_name: Any, new: Any) -> StepCheck:
    if isinstance(grads, ScaledGrads):
        return check_step(state.derivative, grads.found_inf, grads.grads, axis_name=axis_name, new=new, trusted=False)
    if isinstance(grads, dict):  # flags only, e.g. of jaxamp.scaled(jax.jacrev(losses))
        return check_step(state.derivative, grads, (), axis_name=axis_name, new=new)
    raise TypeError(f"jaxamp.apply_or_skip: `grads` must be the ScaledGrads of jaxamp.value_and_grad or the "
                    f"found_inf flags of jaxamp.scaled, got {type(grads).__name__}.")


def apply_or_skip(state: Any, grads: Union[ScaledGrads, dict], applied: T, skipped: T, *,
                  axis_name: Optional[Any] = None, return_reason: bool = False) -> Tuple[Any, ...]:  # fmt: skip
    """Apply or skip an update of any pytrees, and advance every scaler.

    The step is skipped when a flag is set, the gradients are non-finite, or ``applied`` holds a
    non-finite value (``SkipReason.NONFINITE_UPDATES``: e.g. a NaN loss weight; no scaler moves).

    Args:
      state: the :class:`~jaxamp.AmpState` the step ran with, or an optimizer state holding one.
      grads: the :class:`~jaxamp.step.ScaledGrads` of :func:`value_and_grad`, or the
        ``found_inf`` flags of :func:`jaxamp.scaled` (then the loss scaler does not move).
      applied, skipped: pytrees of the same structure: the new values and those kept on a skip.
      axis_name: inside ``pmap``/``shard_map``: OR the flags over this axis.
      return_reason: also return the step's :class:`~jaxamp.SkipReason` (``i32[]``, 0 applied).

    Returns:
      ``(applied or skipped, new state)`` (and the reason), a select: inf/NaN of the unselected
      tree never leak. The new state has the type of ``state``: an optimizer state comes back
      whole, its ``skip_reason`` and ``consecutive_skips`` updated.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> state = jaxamp.init(None, jaxamp.AmpConfig())()
      >>> grads = jaxamp.step.ScaledGrads(jnp.array([jnp.inf]), {})
      >>> params, state, reason = jaxamp.apply_or_skip(state, grads, jnp.array([jnp.nan]), jnp.array([1.0]),
      ...                                              return_reason=True)
      >>> params, float(state.loss_scale), jaxamp.SkipReason(int(reason)).name
      (Array([1.], dtype=float32), 32768.0, 'NONFINITE_GRADS')
    """
    check_flags("jaxamp.apply_or_skip", return_reason=return_reason)
    if jax.tree_util.tree_structure(applied) != jax.tree_util.tree_structure(skipped):
        raise TypeError(f"jaxamp.apply_or_skip: `applied` and `skipped` must have the same pytree structure (the new "
                        f"values and those kept on a skip), got {jax.tree_util.tree_structure(applied)} and "
                        f"{jax.tree_util.tree_structure(skipped)}; pass e.g. (new_params, new_opt) and (params, opt).")
    amp = find(state, "jaxamp.apply_or_skip")
    check = _decide(amp, grads, axis_name, applied)
    new = advance(check, amp)
    if not isinstance(grads, ScaledGrads):  # flags only: the loss scaler stays
        new = new.replace(loss=amp.loss)
    opt = find_opt_state(state) if not isinstance(state, AmpState) else None
    if opt is None:
        out_state = new if isinstance(state, AmpState) else replace_amp(state, new)
    else:  # counted as jaxamp.optimizer counts, a stall reported at its default limit
        stepped = step_state(opt, new, check)
        report_stall(stepped.consecutive_skips, check.skip_reason, check.found_inf, limit=100, on_stall="warn",
                     caller="jaxamp.apply_or_skip")
        out_state = with_opt_state(state, stepped)
    out = (check.select(applied, skipped), out_state)
    return out + (check.skip_reason,) if return_reason else out


def replace_amp(tree: Any, amp: AmpState) -> Any:
    """``tree`` with its one :class:`~jaxamp.AmpState` replaced by ``amp``."""
    is_amp = lambda x: isinstance(x, AmpState)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: amp if is_amp(x) else x, tree, is_leaf=is_amp)


def step_state(opt: AmpOptState, amp: AmpState, check: StepCheck, inner: Any = None) -> AmpOptState:
    """``opt`` after a step: the advanced AMP state, the reason, the consecutive skip count."""
    count = jnp.where(check.apply, 0, jnp.asarray(opt.consecutive_skips, jnp.int32) + 1).astype(jnp.int32)
    return AmpOptState(opt.inner if inner is None else inner, amp, check.skip_reason, count)


class AmpOptimizer(optax.GradientTransformationExtraArgs):
    """The transformation of :func:`optimizer` (an optax ``GradientTransformationExtraArgs``)."""

    __slots__ = ()


def optimizer(inner: optax.GradientTransformation, *, amp_state: Optional[AmpState] = None,
              axis_name: Optional[Any] = None, max_consecutive_skips: int = 100, on_stall: Optional[str] = "warn",
              skip_when_off: bool = False) -> AmpOptimizer:  # fmt: skip
    """Wrap any optax optimizer: skip the update on overflow and advance every scaler.

    Unlike ``optax.apply_if_finite``, a skipped step is a zero update (``-0.0``: the parameters stay
    bit for bit), inner state unchanged. It may stand anywhere in ``optax.chain`` (e.g. after ``optax.clip_by_global_norm``)
    and take gradients ``lax.pmean``-ed or ``lax.psum``-ed over devices (flags OR over them).

    Args:
      inner: any optax ``GradientTransformation``.
      amp_state: the initial :class:`~jaxamp.AmpState` (from :func:`jaxamp.init`); None: given later,
        as ``tx.init(params, amp_state)`` or :func:`with_amp_state` (an optimizer built first).
      axis_name: inside ``pmap``/``shard_map`` with per-device gradients: OR the flags over this axis.
      max_consecutive_skips: this many skipped steps in a row is a stall, reported each time the
        count reaches a multiple of it (a host callback taken only then), a positive int.
      on_stall: ``"warn"`` (a :class:`~jaxamp.monitor.StallWarning`), ``"raise"`` (a :class:`~jaxamp.monitor.StallError`,
        a JAX runtime error from the step) or None: no report in the step, whose host callback costs a small CPU step
        11-20 % of its time (benchmarks/stall_cost.py); ``consecutive_skips`` still counts (for a StallMonitor).
      skip_when_off: with AMP off (float32): False, ``inner`` as written (the user's program bit
        for bit); True, non-finite steps still skip (``make_train_step``'s rule in every precision).

    Returns:
      An :class:`AmpOptimizer` whose ``update`` takes the ``ScaledGrads`` of
      :func:`value_and_grad` called on its state (or plain gradients) and whose state is an
      :class:`AmpOptState` (``amp``, ``skip_reason``, ``consecutive_skips``).

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.optimizer(optax.adam(1e-3), amp_state=jaxamp.init(None, jaxamp.AmpConfig())())
      >>> opt_state = tx.init({"w": jnp.zeros(3)})
      >>> float(opt_state.amp.loss_scale), int(opt_state.consecutive_skips)
      (65536.0, 0)
    """
    if amp_state is not None and not isinstance(amp_state, AmpState):
        raise TypeError(f"jaxamp.optimizer: `amp_state`={amp_state!r} must be a jaxamp.AmpState (from jaxamp.init) or None "
                        "(then give it later: tx.init(params, amp_state) or jaxamp.step.with_amp_state).")
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(f"jaxamp.optimizer: `inner`={inner!r} must be an optax GradientTransformation.")
    n = max_consecutive_skips
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"jaxamp.optimizer: `max_consecutive_skips`={n!r} is not allowed: expected a positive "
                         "integer (steps skipped in a row before a stall is reported), e.g. 100.")
    check_flags("jaxamp.optimizer", skip_when_off=skip_when_off)
    if on_stall not in ON_STALL:
        raise ValueError(f"jaxamp.optimizer: `on_stall`={on_stall!r} is not allowed: expected one of {ON_STALL}.")
    inner, first = optax.with_extra_args_support(inner), amp_state

    def init_fn(params: Any, amp_state: Optional[AmpState] = None) -> AmpOptState:
        amp_state = first if amp_state is None else amp_state
        if amp_state is not None and not isinstance(amp_state, AmpState):
            raise TypeError(f"jaxamp.optimizer(...).init: `amp_state`={amp_state!r} must be a jaxamp.AmpState.")
        zero = jnp.asarray(0, jnp.int32)
        return AmpOptState(inner.init(params), amp_state, zero, zero)

    def update_fn(updates: Any, opt_state: AmpOptState, params: Any = None, **extra: Any):
        if not isinstance(opt_state, AmpOptState):
            raise TypeError(f"jaxamp.optimizer: `state` must be the AmpOptState of this optimizer's init, got "
                            f"{type(opt_state).__name__}.")
        if isinstance(updates, ScaledGrads) and updates.source != "optimizer":
            raise ValueError(
                "jaxamp.optimizer: `updates` were computed by jaxamp.value_and_grad from a bare AmpState, not from "
                "the optimizer's state: the scales in the optimizer's state advance each step, a bare AmpState "
                "stays at its first scales. Fix: jaxamp.value_and_grad(loss)(opt_state, params, ...) with the "
                "state this optimizer returned (for Flax: ts.opt_state).")
        amp, _ = locate(opt_state, "jaxamp.optimizer")
        grads = updates if isinstance(updates, ScaledGrads) else ScaledGrads(unfiltered(updates, "jaxamp.optimizer"), {})
        check_like_params(grads.grads, params, "jaxamp.optimizer")
        new_updates, new_inner = inner.update(grads.grads, opt_state.inner, params, **extra)
        if amp.amp.compute_dtype == jnp.float32 and not skip_when_off:  # AMP off: inner as written
            return new_updates, opt_state._replace(inner=new_inner)
        check = _decide(amp, grads, axis_name, (new_updates, new_inner))
        new_updates, new_inner = check.keep(new_updates, new_inner, opt_state.inner)
        new_state = step_state(opt_state, advance(check, amp), check, new_inner)
        if on_stall is not None:
            report_stall(new_state.consecutive_skips, check.skip_reason, check.found_inf, limit=n,
                         on_stall=on_stall, caller="jaxamp.optimizer")
        return new_updates, new_state

    return AmpOptimizer(init_fn, update_fn)
