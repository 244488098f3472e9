"""The pieces of a mixed-precision train step (docs/algorithm.md, "Training step").

(1) gradients of ``loss * loss_scale``, unscaled (:func:`loss_scaled_grad`; with an engine's
explicit flags :func:`scaled_value_and_grad`); (2) the apply-or-skip decision over any pytrees
(:func:`check_step`, :meth:`StepCheck.select`); (3) the scaler updates (:func:`update_scalers`).
:func:`jaxamp.value_and_grad`, :func:`jaxamp.apply_or_skip`, :func:`jaxamp.optimizer` and
:func:`jaxamp.train.make_train_step` are built from them. All branches are selects: no host
synchronisation, one compilation.
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
# loss_fn(params, *args) -> (loss f32[], (terms {name: f32[]}, found_inf {key: bool[]}[, metrics {name: f32[]}]))
LossFn = Callable[..., Tuple[jax.Array, Tuple]]



class SkipReason(enum.IntEnum):
    """Why a step was skipped (``metrics["skip_reason"]``, ``AmpOptState.skip_reason``;
    docs/algorithm.md, "Training step"). An ``int`` enum: compare with the ``i32`` arrays.

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
    """What :func:`jaxamp.value_and_grad` returns as gradients: the weight gradients (the loss
    scale divided out) and the derivative flags of the same evaluation. The optimizer of
    :func:`jaxamp.optimizer` and :func:`jaxamp.apply_or_skip` take it as it is."""

    grads: Any
    found_inf: Dict[str, jax.Array]

CONTRACT = (
    "loss_fn(params, *args) must return (loss, (terms, found_inf)) or (loss, (terms, found_inf, metrics)): "
    "loss a float scalar, terms a dict {name: scalar} of loss terms to report (may be empty), found_inf the "
    "derivative engines' flags {key: bool[]} (merge several with jaxamp.marks.merge_found_inf), metrics an optional "
    "dict {name: scalar} of extra metrics to report (e.g. jaxamp.headroom.headroom_metrics(...)). Example: "
    'return pde + bc, ({"pde": pde, "bc": bc}, found_inf)'
)


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array of dtype {x.dtype} and shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)} ({', '.join(_describe(v) for v in x)})"
    return f"a {type(x).__name__}"


def check_loss_output(out: Any, *, with_metrics: bool = False) -> Tuple:
    """``(loss, terms, found_inf)`` from a loss function's output, or a TypeError showing the contract.

    Args:
      out: what ``loss_fn`` returned: ``(loss, (terms, found_inf))`` or
        ``(loss, (terms, found_inf, metrics))`` with ``metrics`` a dict ``{name: scalar}``.
      with_metrics: also return the metrics (``{}`` for a 2-tuple).

    Returns:
      Its loss, terms and found_inf (and metrics when ``with_metrics``), checked.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp.step import check_loss_output
      >>> out = (jnp.float32(1.5), ({"pde": jnp.float32(1.5)}, {"2": jnp.array(False)}))
      >>> loss, terms, found_inf, metrics = check_loss_output(out, with_metrics=True)
      >>> float(loss), sorted(terms), metrics
      (1.5, ['pde'], {})
      >>> check_loss_output(jnp.float32(1.5))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: loss_fn returned an array of dtype float32 and shape (): loss_fn(params, *args) must return ...
    """
    ok = isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], (tuple, list)) and len(out[1]) in (2, 3)
    if ok:
        loss, (terms, found_inf, *extra) = out
        ok = (hasattr(loss, "shape") and jnp.shape(loss) == () and jnp.issubdtype(jnp.result_type(loss), jnp.floating)
              and isinstance(terms, Mapping) and isinstance(found_inf, Mapping)
              and all(isinstance(m, Mapping) for m in extra))
    if not ok:
        raise TypeError(f"loss_fn returned {_describe(out)}: {CONTRACT}.")
    metrics = dict(extra[0]) if extra else {}
    for name, v in metrics.items():
        if not isinstance(name, str) or jnp.shape(v) != ():
            raise TypeError(f"loss_fn returned the metric {name!r} = {_describe(v)}: metrics must map names "
                            f"(str) to scalars (shape ()); {CONTRACT}.")
    return (loss, terms, found_inf, metrics) if with_metrics else (loss, terms, found_inf)


def scaled_value_and_grad(loss_fn: LossFn) -> Callable[..., Tuple[Tuple[jax.Array, Tuple], Any]]:
    """``jax.value_and_grad`` of ``loss_fn`` with the loss scaled up and the gradients unscaled.

    The gradients are those of ``loss * loss_scale`` (float32), divided by ``loss_scale``:
    in float16 weight gradients that would underflow survive, and a too large scale shows
    as non-finite gradients (:func:`check_step` tells).

    Args:
      loss_fn: ``loss_fn(params, *args) -> (loss, (terms, found_inf))``, or
        ``(loss, (terms, found_inf, metrics))`` with extra scalar metrics; any other output
        raises a TypeError that shows this contract.

    Returns:
      ``grad_fn(params, *args, loss_scale) -> ((loss, aux), grads)`` with ``aux`` as
      ``loss_fn`` gave it (``(terms, found_inf)`` or ``(terms, found_inf, metrics)``),
      ``loss_scale`` an ``f32[]`` (1.0 when loss scaling is off); ``loss`` is unscaled.

    Example (a loss without derivative engines: no terms, no flags):
      >>> import jax.numpy as jnp, jaxamp.step
      >>> loss_fn = lambda p, x, scales: (jnp.sum((p * x) ** 2), ({}, {}))
      >>> grad_fn = jaxamp.step.scaled_value_and_grad(loss_fn)
      >>> (loss, (terms, found_inf)), grads = grad_fn(jnp.float32(2.0), jnp.float32(3.0), {}, loss_scale=2.0**16)
      >>> float(loss), float(grads)  # d(p x)^2/dp = 2 p x^2, the loss scale divided out
      (36.0, 36.0)
    """
    if not callable(loss_fn):
        raise TypeError(f"scaled_value_and_grad: `loss_fn`={loss_fn!r} must be callable: {CONTRACT}.")

    def grad_fn(params: Any, *args: Any, loss_scale: jax.Array) -> Tuple[Tuple[jax.Array, Tuple], Any]:
        def checked(params: Any) -> Tuple[jax.Array, Tuple]:
            out = loss_fn(params, *args)
            loss, terms, found_inf, metrics = check_loss_output(out, with_metrics=True)
            return loss, ((terms, found_inf, metrics) if len(out[1]) == 3 else (terms, found_inf))

        grads, (loss, aux) = loss_scaled_grad(checked, 0, loss_scale)(params)
        return (loss, aux), grads

    return grad_fn


def loss_scaled_grad(fun: Callable[..., Tuple[jax.Array, Any]], argnums: Any,
                     loss_scale: Optional[jax.Array]) -> Callable[..., Tuple[Any, Tuple[jax.Array, Any]]]:  # fmt: skip
    """The gradients of ``fun``'s loss times ``loss_scale`` (float32), divided by it: the one
    loss-scaled gradient of :func:`scaled_value_and_grad` and :func:`jaxamp.value_and_grad`.

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
        the same structure (params, optimizer state, loss weights, EMA, ...). A select, not a
        blend: inf/NaN in the unselected tree never leak.

        Example:
          >>> import jax.numpy as jnp, jaxamp
          >>> scalers = jaxamp.init(None, jaxamp.AmpConfig(dtype="float16"), keys=["2"])().derivative
          >>> check = jaxamp.step.check_step({"2": jnp.array(True)}, {"w": jnp.ones(2)}, scalers)
          >>> check.select({"w": jnp.full(2, jnp.nan)}, {"w": jnp.ones(2)})  # skipped: the old params
          {'w': Array([1., 1.], dtype=float32)}
        """
        return jmp.select_tree(self.apply, applied, skipped)


def _any(flags: Any) -> jax.Array:
    leaves = [jnp.asarray(x, bool).reshape(()) for x in jax.tree_util.tree_leaves(flags)]
    return jnp.stack(leaves).any() if leaves else jnp.asarray(False)


def check_step(found_inf: Flags, grads: Any, scalers: Mapping[str, Any], *, axis_name: Optional[Any] = None) -> StepCheck:
    """Decide whether a step applies, and why not.

    Precedence (docs/algorithm.md, "Training step"): bad values (``found_inf[NONFINITE_VALUES]``)
    over a derivative overflow over non-finite weight gradients. Bad values make every later
    quantity non-finite and no scale can cure them, so they must not be blamed on a scaler; a
    derivative overflow makes the loss and gradients non-finite, so it must not be blamed on the
    loss scaler.

    Args:
      found_inf: ``{key: bool[]}`` from the derivative engines, ``NONFINITE_VALUES`` included.
      grads: the unscaled weight gradients (any pytree).
      scalers: the derivative scalers (or any mapping with the same keys); a flag whose key is
        neither one of them nor ``NONFINITE_VALUES`` is an error.
      axis_name: inside ``pmap``/``shard_map``/``vmap`` with a named axis: the flags are OR-ed
        over it, so every replica takes the same decision.

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
            f"{sorted(scalers)}). Create the state with TrainState.create(..., engines=[every engine the loss uses])."
        )
    flags = {k: jnp.asarray(found_inf.get(k, False), bool).reshape(()) for k in scalers}
    values = jnp.asarray(found_inf.get(NONFINITE_VALUES, False), bool).reshape(())
    finite = jmp.all_finite(grads)
    if axis_name is not None:
        reduce = lambda b: jax.lax.pmax(b.astype(jnp.int32), axis_name) > 0  # noqa: E731
        flags, values, finite = {k: reduce(v) for k, v in flags.items()}, reduce(values), ~reduce(~finite)
    overflow = _any(flags)
    reason = jnp.where(values, int(SkipReason.NONFINITE_VALUES), jnp.where(overflow, int(SkipReason.DERIVATIVE_OVERFLOW),
                       jnp.where(finite, int(SkipReason.APPLIED), int(SkipReason.NONFINITE_GRADS))))
    return StepCheck(apply=reason == int(SkipReason.APPLIED), skip_reason=reason.astype(jnp.int32), found_inf=flags,
                     nonfinite_values=values, derivative_overflow=overflow, grads_finite=finite)


def update_scalers(
    check: StepCheck, scalers: Scalers, loss_scale: ScaleState, loss_rule: Optional[DynamicScaler]
) -> Tuple[Scalers, ScaleState]:
    """The scaler updates after a step (docs/algorithm.md, "Training step").

    - bad values: no scaler changes, not even a tracker;
    - otherwise every derivative scaler steps with its own flag, skipped step or not;
    - the loss scaler steps with "gradients non-finite" unless a derivative overflowed.

    Args:
      check: this step's :class:`StepCheck`.
      scalers: the derivative scalers.
      loss_scale: the loss scaler's state.
      loss_rule: the loss scaler's rule (``amp.make_loss_scaler()``), or None when loss
        scaling is off (the state stays as it is).

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
