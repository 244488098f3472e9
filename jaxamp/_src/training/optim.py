"""A user's train step in three lines: :func:`value_and_grad`, :func:`optimizer`, :func:`apply_or_skip`.

docs/algorithm.md, "Training step", over one :class:`~jaxamp.AmpState`: :func:`value_and_grad` scales every
derivative in the loss and the loss itself (:func:`loss_scaled_grad`) and returns ``(value, grads, flags)``:
the gradients the plain tree of the parameters, the flags (:class:`~jaxamp._src.training.step.StepFlags`)
what the step decides on. :func:`optimizer` is an optax ``GradientTransformationExtraArgs`` wrapping the whole
optimizer, as ``optax.MultiSteps`` does: ``update(grads, opt_state, params, flags=flags)`` applies or skips
the inner update and advances every scaler; the AMP state, the decision and the skip count live in its state
(an :class:`~jaxamp._src.training.step.AmpOptState`). :func:`apply_or_skip` does the same for any pytrees.
The decision itself is :func:`jaxamp._src.training.step.decide`, which both call; this module checks the
user's arguments, computes the gradients and reports a stall.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, TypeVar, Union

import jax
import jax.numpy as jnp
import optax

from jaxamp._src.core.checks import check_fun
from jaxamp._src.core.marks import NONFINITE_VALUES, any_set
from jaxamp._src.core.modules import filter_grad
from jaxamp._src.core.scaled import scaled
from jaxamp._src.placement.held import held_operands
from jaxamp._src.scaling.config import check_flags
from jaxamp._src.scaling.state import AmpState, find
from jaxamp._src.training.flags import all_finite, flag_set, skipped_updates, zeroed_when
from jaxamp._src.training.monitor import STALL_LIMIT, report_stall
from jaxamp._src.placement.recompute import recomputed_grad
from jaxamp._src.training.step import AmpOptState, StepCheck, StepFlags, decide, find_opt_state, found_inf_of, locate

__all__ = ["loss_scaled_grad", "value_and_grad", "grad_norms", "apply_or_skip", "optimizer", "AmpOptimizer",
           "scaled_value_fn", "check_like_params", "with_amp_state"]

T = TypeVar("T")
ON_STALL = ("warn", "raise", None)


def loss_scaled_grad(fun: Callable[..., Tuple[jax.Array, Any]], argnums: Any, loss_scale: Optional[jax.Array],
                     held: bool = False, written: bool = True, recompute: bool = False
                     ) -> Callable[..., Tuple[Any, Tuple[jax.Array, Any]]]:
    """The gradients of ``fun``'s loss times ``loss_scale`` (float32), divided by it, as in
    :func:`value_and_grad`: float16 weight gradients that would underflow survive.

    Args:
      fun: ``fun(*args) -> (loss, aux)``.
      argnums: as ``jax.grad``.
      loss_scale: ``f32[]``, or None (loss scaling off: nothing multiplies).
      held: per-tensor scaled products take widened operands as they are held
        (:func:`jaxamp._src.placement.held.held_operands`: the cotangents of float16 activations).
      written: the matrices' gradients written out as the backward pass makes them
        (:func:`_written_out`); False: the gradients as ``jax.grad`` gives them (AMP off: the user's program).
      recompute: the backward pass stores only the 16-bit matmul outputs and recomputes the float32
        values (:func:`jaxamp._src.placement.recompute.recomputed_grad`; ``AmpConfig.recompute_float32``).

    Returns:
      ``g(*args) -> (grads, (loss, aux))``, ``loss`` unscaled.
    """

    def g(*args: Any) -> Tuple[Any, Tuple[jax.Array, Any]]:
        s = None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)

        def scaled_loss(*a: Any) -> Tuple[jax.Array, Tuple[jax.Array, Any]]:
            loss, aux = fun(*a)
            return (loss if s is None else loss.astype(jnp.float32) * s), (loss, aux)

        grad = recomputed_grad if recompute else functools.partial(jax.grad, has_aux=True)
        grads, out = grad(scaled_loss, argnums)(*args)
        grads = _written_out(grads) if written else grads
        if s is None:
            return grads, out
        inv = jnp.float32(1.0) / s
        return jax.tree_util.tree_map(lambda x: x * inv.astype(x.dtype), grads), out

    return held_operands(g) if held else g


def _written_out(grads: Any) -> Any:
    """``grads`` with each matrix's (2 or more dimensions longer than 1) written out as the backward pass
    made it, the unscale, the checks and the skip's selects fused into its consumers. Without it XLA fuses
    a weight gradient's last stage (the sum of a split-K GEMM's partial products) into each consumer and
    keeps the partials live until the optimizer's decision (H100 program, 4x512/6000: 32 MiB more device
    temp memory with fp16, 43 MiB with bf16). The vectors' (biases', a one-output layer's ``[width, 1]``
    kernel's) unscale fuses into the reduction that makes them (a kernel fewer each than writing them
    out; docs/gpu.md)."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    matrices = [i for i, x in enumerate(leaves) if sum(d > 1 for d in jnp.shape(x)) >= 2]
    for i, x in zip(matrices, jax.lax.optimization_barrier([leaves[i] for i in matrices])):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def with_amp_state(opt_state: Any, amp_state: AmpState) -> Any:
    """``opt_state`` (any tree holding one :class:`AmpOptState`) with its AMP state set: the
    one-liner for an optimizer built before the loss existed (``jaxamp.optimizer(inner)``).

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from jaxamp._src.training.optim import with_amp_state
      >>> from jaxamp._src.training.step import find_opt_state
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.optimizer(optax.adam(1e-3)))
      >>> opt_state = tx.init({"w": jnp.zeros(3)})  # no AMP state yet
      >>> opt_state = with_amp_state(opt_state, jaxamp.init(None, jaxamp.AmpConfig())())
      >>> float(find_opt_state(opt_state).amp.loss_scale)
      65536.0
    """
    if not isinstance(amp_state, AmpState):
        raise TypeError(f"jaxamp._src.training.optim.with_amp_state: `amp_state`={amp_state!r} must be a "
                        "jaxamp.AmpState "
                        "(from jaxamp.init(loss, amp)(params, batch)).")
    if find_opt_state(opt_state) is None:
        raise TypeError(f"jaxamp._src.training.optim.with_amp_state: `opt_state` (a {type(opt_state).__name__}) "
                        "must hold exactly "
                        "one AmpOptState: the state of jaxamp.optimizer(...).init(params).")
    is_opt = lambda x: isinstance(x, AmpOptState)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: x._replace(amp=amp_state) if is_opt(x) else x, opt_state, is_leaf=is_opt)


def _loss_of(out: Any, has_aux: bool, fun: Callable) -> Tuple[jax.Array, Any]:
    def what(x: Any) -> str:
        return f"an array of shape {jnp.shape(x)}" if hasattr(x, "shape") else type(x).__name__

    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f"jaxamp.value_and_grad: `fun`={fun!r} with has_aux=True must return (loss, aux), "
                        f"got {what(out)}.")
    loss, aux = out if has_aux else (out, None)
    if not (hasattr(loss, "shape") and jnp.shape(loss) == () and jnp.issubdtype(jnp.result_type(loss), jnp.floating)):
        raise TypeError(f"jaxamp.value_and_grad: `fun`={fun!r} must return a float scalar loss (or (loss, aux) with "
                        f"has_aux=True), got {what(loss)}; for a vector of losses use jaxamp.scaled(jax.jacrev(fun)).")
    return loss, aux


def _bad_values(args: Sequence[Any], kwargs: Dict[str, Any], argnums: Any, found: Dict[str, Any],
                loss: jax.Array) -> jax.Array:
    """``bool[]``: bad values (``NONFINITE_VALUES``), which no scale cures and which would otherwise
    read as non-finite weight gradients (bf16 and plain fp16 have no derivative checks): the
    derivative checks' own; a non-finite float in the arguments not differentiated (the batch: a
    NaN point); or a non-finite loss where no derivative scaler overflowed (its forward value: a
    source term computed in float16 from the batch, a network output beyond float16, under plain
    fp16 a derivative beyond float16). A loss scale multiplies only the backward pass."""
    nums = {argnums} if isinstance(argnums, int) else set(argnums)
    batch = [a for i, a in enumerate(args) if i not in nums] + list(kwargs.values())
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if hasattr(x, "dtype")]
    # a chain of ORs, fused into the one kernel of the step's scalars (H100 program: one kernel
    # fewer than a reduction of its own, docs/gpu.md)
    overflowed = functools.reduce(jnp.logical_or, [flag_set(v) for k, v in found.items() if k != NONFINITE_VALUES],
                                  jnp.bool_(False))
    bad_loss = ~all_finite([loss]) & ~overflowed
    return flag_set(found.get(NONFINITE_VALUES, False)) | ~all_finite(leaves) | bad_loss


def value_and_grad(fun: Callable[..., Any], argnums: Union[int, Sequence[int]] = 0, has_aux: bool = False, *,
                   merge: bool = True, headroom: bool = False) -> Callable[..., Tuple[Any, Any, StepFlags]]:
    """``jax.value_and_grad`` with the derivative scalers and the loss scaler of an AMP state.

    Args:
      fun: ``fun(params, *args) -> loss`` (a float scalar), or ``(loss, aux)`` with
        ``has_aux=True``; its derivatives written with :func:`jaxamp.grad` and its siblings, or
        JAX's own through an :func:`jaxamp.autocast` network.
      argnums, has_aux: as ``jax.value_and_grad``; Equinox / NNX modules as ``eqx.filter_value_and_grad`` does.
      merge: as :func:`jaxamp.scaled`.
      headroom: also report each key's headroom (``flags.headroom_log2``).

    Returns:
      ``vg(state, *args, **kwargs) -> (value, grads, flags)``: ``state`` the state of
      :func:`optimizer` (or a bare :class:`~jaxamp.AmpState` for :func:`apply_or_skip`);
      ``value`` unscaled (``(loss, aux)`` with ``has_aux``); ``grads`` the plain gradient tree,
      loss scale divided out, zeros when a flag is set; ``flags`` a :class:`~jaxamp._src.training.step.StepFlags`
      for ``optimizer.update(grads, opt_state, params, flags=flags)``.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> loss = lambda p, x: jaxamp.grad(lambda p, x: jnp.sin(p * x), 1)(p, x) ** 2
      >>> state = jaxamp.init(loss, jaxamp.AmpConfig())(2.0, 0.5)
      >>> value, grads, flags = jaxamp.value_and_grad(loss)(state, 2.0, 0.5)
      >>> sorted(flags.found_inf)
      ['1', 'nonfinite_values']
    """
    check_fun("jaxamp.value_and_grad", fun, None)
    check_flags("jaxamp.value_and_grad", has_aux=has_aux, merge=merge, headroom=headroom)

    def vg(state: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any, StepFlags]:
        amp_state, source = locate(state, "jaxamp.value_and_grad")
        marked = scaled(fun, amp_state.amp, merge=merge, headroom=True)
        # static: with loss scaling off nothing multiplies
        loss_scale = None if amp_state.loss_rule is None else amp_state.loss_scale

        def loss_of(*a):
            out, found, room = marked(amp_state.scales, *a, **kwargs)
            loss, aux = _loss_of(out, has_aux, fun)
            return loss, (aux, found, room)

        held = amp_state.amp.tensor_scaling  # float16 cotangents widened: multiplied as float16 (no amax)
        grad_of = functools.partial(loss_scaled_grad, written=not amp_state.amp.off,
                                    recompute=amp_state.amp.recomputes)
        grads, (loss, (aux, found, room)) = filter_grad(grad_of, loss_of, argnums, loss_scale, held)(*args)
        if not amp_state.amp.off:  # AMP off: the user's program as written
            found = {**found, NONFINITE_VALUES: _bad_values(args, kwargs, argnums, found, loss)}
            # zeroed when a flag is set: a norm of them (a clip, loss weights) stays finite
            grads = zeroed_when([flag_set(v) for v in found.values()], grads)
        flags = StepFlags({k: flag_set(v) for k, v in found.items()}, room if headroom else {}, source=source)
        return ((loss, aux) if has_aux else loss), grads, flags

    return vg


def grad_norms(losses: Callable[..., Dict[str, Any]], argnums: Union[int, Sequence[int]] = 0
               ) -> Callable[..., Tuple[Dict[str, jax.Array], jax.Array]]:
    """The global norm of each loss term's gradient, for loss weights balanced by gradient norms
    (jaxpi's, NTK-style): scaled as :func:`value_and_grad` scales the step, never NaN or inf.

    Args:
      losses: ``losses(params, *args) -> {name: f32[]}``, the loss terms by name.
      argnums: as :func:`value_and_grad`.

    Returns:
      ``norms(state, params, *args) -> ({name: f32[]}, ok)``: each term's gradient norm, loss scale
      divided out; ``ok`` (``bool[]``) False where a term's derivative overflowed, its gradients
      are non-finite (the loss scale too high for it) or a norm is 0, and then every norm is 1.0.
      Keep the old weights on such a step: ``weights = jnp.where(ok, new_weights, weights)``.

    Example:
      >>> import jax.numpy as jnp, jaxamp
      >>> losses = lambda p, x: {"pde": jnp.sum((p * x) ** 2), "bc": (p - 1.0) ** 2}
      >>> state = jaxamp.init(losses, jaxamp.AmpConfig())(2.0, jnp.ones(3))
      >>> norms, ok = jaxamp.grad_norms(losses)(state, 2.0, jnp.ones(3))
      >>> {k: float(v) for k, v in norms.items()}, bool(ok)
      ({'bc': 2.0, 'pde': 12.0}, True)
    """
    check_fun("jaxamp.grad_norms", losses, None)

    def norms(state: Any, *args: Any, **kwargs: Any) -> Tuple[Dict[str, jax.Array], jax.Array]:
        amp = find(state, "jaxamp.grad_norms")
        terms = jax.eval_shape(lambda *a: scaled(losses, amp.amp)(amp.scales, *a, **kwargs)[0], *args)
        if not isinstance(terms, dict) or not terms:
            raise TypeError(f"jaxamp.grad_norms: `losses`={losses!r} must return a non-empty dict of scalar loss "
                            f"terms by name, got {type(terms).__name__}.")
        out, bad = {}, []
        for name in sorted(terms):
            _, grads, flags = value_and_grad(lambda *a, name=name: losses(*a, **kwargs)[name], argnums)(state, *args)
            out[name] = optax.tree.norm(grads)
            bad += [flag_set(v) for v in flags.found_inf.values()] + [~jnp.isfinite(out[name]), out[name] == 0]
        ok = ~any_set(bad)
        return {k: jnp.where(ok, v, jnp.float32(1.0)) for k, v in out.items()}, ok

    return norms


def apply_or_skip(state: Any, grads: Any, flags: Union[StepFlags, dict], applied: T, skipped: T, *,
                  axis_name: Optional[Any] = None, return_reason: bool = False) -> Tuple[Any, ...]:
    """Apply or skip an update of any pytrees, and advance every scaler.

    The step is skipped when a flag is set, the gradients are non-finite, or ``applied`` holds a
    non-finite value (``SkipReason.NONFINITE_UPDATES``: e.g. a NaN loss weight; no scaler moves).

    Args:
      state: the :class:`~jaxamp.AmpState` the step ran with, or an optimizer state holding one.
      grads: the step's gradients (checked finite: the loss scaler steps on them), or None for
        flags without gradients (then the loss scaler does not move).
      flags: the :class:`~jaxamp._src.training.step.StepFlags` of :func:`value_and_grad`, or the ``found_inf``
        dict of :func:`jaxamp.scaled`.
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
      >>> params, state, reason = jaxamp.apply_or_skip(state, jnp.array([jnp.inf]), {}, jnp.array([jnp.nan]),
      ...                                              jnp.array([1.0]), return_reason=True)
      >>> params, float(state.loss_scale), jaxamp.SkipReason(int(reason)).name
      (Array([1.], dtype=float32), 32768.0, 'NONFINITE_GRADS')
    """
    check_flags("jaxamp.apply_or_skip", return_reason=return_reason)
    if jax.tree_util.tree_structure(applied) != jax.tree_util.tree_structure(skipped):
        raise TypeError(f"jaxamp.apply_or_skip: `applied` and `skipped` must have the same pytree structure (the new "
                        f"values and those kept on a skip), got {jax.tree_util.tree_structure(applied)} and "
                        f"{jax.tree_util.tree_structure(skipped)}; pass e.g. (new_params, new_opt) and (params, opt).")
    amp = find(state, "jaxamp.apply_or_skip")
    found = found_inf_of(flags, "jaxamp.apply_or_skip")
    if grads is None and isinstance(flags, StepFlags) and amp.loss_rule is not None:
        raise TypeError("jaxamp.apply_or_skip: `grads` is None beside the StepFlags of jaxamp.value_and_grad: their "
                        "gradients were loss-scaled, and unchecked they could never back the loss scale off. Fix: "
                        "pass them, jaxamp.apply_or_skip(state, grads, flags, applied, skipped).")
    chosen, new_state, check = decide(state, found, grads, applied, skipped, caller="jaxamp.apply_or_skip",
                                      axis_name=axis_name)
    # an optimizer state counts its skips as jaxamp.optimizer does, a stall reported at the default limit
    _report_stall(new_state, check, limit=STALL_LIMIT, on_stall="warn", caller="jaxamp.apply_or_skip")
    out = (chosen, new_state)
    return out + (check.skip_reason,) if return_reason else out


def _report_stall(state: Any, check: StepCheck, *, limit: int, on_stall: Optional[str], caller: str) -> None:
    """The stall report of :func:`jaxamp._src.training.monitor.report_stall` for ``state`` after a step,
    when it is an optimizer state (which counts the skips in a row) and ``on_stall`` is not None."""
    opt = find_opt_state(state) if not isinstance(state, AmpState) else None
    if opt is None or on_stall is None:
        return
    loss_scale = None if opt.amp.loss_rule is None else opt.amp.loss_scale
    report_stall(opt.consecutive_skips, check.skip_reason, check.found_inf, limit=limit, on_stall=on_stall,
                 caller=caller, loss_scale=loss_scale)


class AmpOptimizer(optax.GradientTransformationExtraArgs):
    """The transformation of :func:`optimizer` (an optax ``GradientTransformationExtraArgs``)."""

    __slots__ = ()


def _needs_flags(amp: AmpState) -> bool:
    """Whether gradients for ``amp`` must come from :func:`value_and_grad`: a scaler acts (a loss
    scale or a derivative scale), so plain gradients would be unscaled."""
    return not amp.amp.off and (amp.loss_rule is not None or len(amp.derivative) > 0)


def scaled_value_fn(value_fn: Callable[..., Any], amp: AmpState) -> Callable[..., jax.Array]:
    """``value_fn`` (``params -> loss``, as optax's line searches call it) under ``amp``'s scales:
    its derivatives scaled and checked; a trial point where a flag is set is worth ``+inf`` (the
    line search shortens the step), never an unscaled fp16 value."""
    marked = scaled(value_fn, amp.amp)

    def value(*args: Any, **kwargs: Any) -> jax.Array:
        out, found = marked(amp.scales, *args, **kwargs)
        bad = any_set([flag_set(v) for v in found.values()]) if found else jnp.bool_(False)
        return jnp.where(bad, jnp.inf, out)

    return value


def _check_optimizer_args(inner: Any, amp_state: Any, loss: Any, max_consecutive_skips: Any, on_stall: Any,
                          skip_when_off: Any) -> None:
    """:func:`optimizer`'s arguments checked, the first bad one raising with its fix."""
    if amp_state is not None and not isinstance(amp_state, AmpState):
        raise TypeError(f"jaxamp.optimizer: `amp_state`={amp_state!r} must be a jaxamp.AmpState (from jaxamp.init) "
                        "or None "
                        "(then set it later: jaxamp._src.training.optim.with_amp_state(opt_state, amp_state)).")
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(f"jaxamp.optimizer: `inner`={inner!r} must be an optax GradientTransformation.")
    if loss is not None and not callable(loss):
        raise TypeError(f"jaxamp.optimizer: `loss`={loss!r} must be None or callable as loss(params, **extra_args) "
                        "-> a float scalar (the extra arguments the training loop passes to update).")
    n = max_consecutive_skips
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"jaxamp.optimizer: `max_consecutive_skips`={n!r} is not allowed: expected a positive "
                         "integer (steps skipped in a row before a stall is reported), e.g. 100.")
    check_flags("jaxamp.optimizer", skip_when_off=skip_when_off)
    if on_stall not in ON_STALL:
        raise ValueError(f"jaxamp.optimizer: `on_stall`={on_stall!r} is not allowed: expected one of {ON_STALL}.")


def _update_flags(flags: Any, amp: AmpState) -> Dict[str, Any]:
    """The ``found_inf`` of the ``flags`` given to the optimizer's ``update`` (``{}`` for none), or the
    error naming :func:`value_and_grad` when they cannot be the flags of its gradients."""
    if isinstance(flags, StepFlags) and flags.source != "optimizer":
        raise ValueError(
            "jaxamp.optimizer: `flags` were computed by jaxamp.value_and_grad from a bare AmpState, not from "
            "the optimizer's state: the scales in the optimizer's state advance each step, a bare AmpState "
            "stays at its first scales. Fix: jaxamp.value_and_grad(loss)(opt_state, params, ...) with the "
            "state this optimizer returned.")
    if flags is None and _needs_flags(amp):
        raise TypeError(
            "jaxamp.optimizer: gradients without `flags` while a scaler acts (loss scale, derivative scales "
            f"{sorted(amp.derivative)}): gradients not computed by jaxamp.value_and_grad are unscaled and "
            "unchecked (e.g. jax.value_and_grad, or a library's own loop). Fix: loss, grads, flags = "
            "jaxamp.value_and_grad(loss)(opt_state, params, batch); then "
            "optimizer.update(grads, opt_state, params, flags=flags); in a library's own loop, "
            "jaxamp.optimizer(inner, amp_state=..., loss=loss) with the loop passing loss's arguments as "
            "extra arguments of update.")
    return {} if flags is None else found_inf_of(flags, "jaxamp.optimizer")


def optimizer(inner: optax.GradientTransformation, *, amp_state: Optional[AmpState] = None,
              loss: Optional[Callable[..., Any]] = None, axis_name: Optional[Any] = None,
              max_consecutive_skips: int = STALL_LIMIT, on_stall: Optional[str] = "warn",
              skip_when_off: bool = False) -> AmpOptimizer:
    """Wrap a whole optax optimizer: skip the update on overflow and advance every scaler.

    ``update(grads, opt_state, params, flags=flags, **extra)`` takes the plain gradients and the
    :class:`~jaxamp._src.training.step.StepFlags` of :func:`value_and_grad`. On a skip the update is ``-0.0``
    (``optax.apply_updates`` leaves the parameters bit for bit) and the inner state is the old one,
    whole: its moments, counts, schedules' steps, ``reduce_on_plateau``'s history and
    ``MultiSteps``' accumulator do not move (a schedule counts applied steps). Unlike
    ``optax.apply_if_finite``, no NaN is ever applied.

    Where it may stand: outermost, or after stateless transformations (``optax.chain(
    optax.clip_by_global_norm(1.0), jaxamp.optimizer(adam))``). Inside a stateful one
    (``optax.chain(jaxamp.optimizer(a), b)``, ``optax.MultiSteps(jaxamp.optimizer(a))``) it is refused
    by :func:`value_and_grad` with the fix: ``jaxamp.optimizer(optax.chain(a, b))``.

    Extra arguments go to ``inner`` (``value=`` for ``reduce_on_plateau``, ``value``/``grad``/
    ``value_fn`` for ``optax.lbfgs``); a ``value_fn`` runs under the state's scales
    (:func:`scaled_value_fn`).

    A library that computes its own gradients and calls ``tx.update(grads, opt_state, params,
    **extra)`` in its own loop (jinns's ``solve`` with ``extra_optax_args_and_kwargs``): build
    ``jaxamp.optimizer(inner, amp_state=..., loss=loss)`` and have the loop pass what ``loss`` needs
    as extra arguments; ``update`` then computes the gradients and flags itself,
    ``value_and_grad(loss)(opt_state, params, **extra)``, in place of the library's (unscaled)
    ones, which XLA drops when nothing else reads them.

    Args:
      inner: any optax ``GradientTransformation``.
      amp_state: the initial :class:`~jaxamp.AmpState` (from :func:`jaxamp.init`); None: set later
        with :func:`with_amp_state` (an optimizer built first).
      loss: None, or ``loss(params, **extra) -> f32[]``: the gradients are recomputed from it
        (see above); ``update`` then takes no ``flags``.
      axis_name: inside ``pmap``/``shard_map`` with per-device gradients: OR the flags over this axis.
      max_consecutive_skips: this many skipped steps in a row is a stall, reported each time the
        count reaches a multiple of it (a host callback taken only then), a positive int.
      on_stall: ``"warn"`` (a :class:`~jaxamp.StallWarning`), ``"raise"`` (a :class:`~jaxamp.StallError`,
        a JAX runtime error from the step) or None: no report in the step (``consecutive_skips`` still counts).
      skip_when_off: with AMP off (float32): False, ``inner`` as written (the user's program bit
        for bit); True, non-finite steps still skip (``make_train_step``'s rule in every precision).

    Returns:
      An :class:`AmpOptimizer` whose state is an :class:`AmpOptState` (``inner``, ``amp``,
      ``skip_reason``, ``consecutive_skips``). Gradients without ``flags`` while a scaler acts are
      an error naming :func:`value_and_grad` (they would be unscaled).

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.optimizer(optax.adam(1e-3), amp_state=jaxamp.init(None, jaxamp.AmpConfig())())
      >>> opt_state = tx.init({"w": jnp.zeros(3)})
      >>> float(opt_state.amp.loss_scale), int(opt_state.consecutive_skips)
      (65536.0, 0)
    """
    _check_optimizer_args(inner, amp_state, loss, max_consecutive_skips, on_stall, skip_when_off)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> AmpOptState:
        return AmpOptState.start(inner.init(params), amp_state)

    def update_fn(updates: Any, opt_state: AmpOptState, params: Any = None, *, flags: Any = None, **extra: Any):
        if not isinstance(opt_state, AmpOptState):
            raise TypeError(f"jaxamp.optimizer: `state` must be the AmpOptState of this optimizer's init, got "
                            f"{type(opt_state).__name__}.")
        amp, _ = locate(opt_state, "jaxamp.optimizer")
        if loss is not None:
            if flags is not None:
                raise TypeError("jaxamp.optimizer: `flags` given to an optimizer built with `loss=`: it computes "
                                "the gradients and flags itself; drop one of them.")
            _, updates, flags = value_and_grad(loss)(opt_state, params, **extra)
        found, grads = _update_flags(flags, amp), updates
        check_like_params(grads, params, "jaxamp.optimizer")
        if "value_fn" in extra and not amp.amp.off:
            extra = {**extra, "value_fn": scaled_value_fn(extra["value_fn"], amp)}
        new_updates, new_inner = inner.update(grads, opt_state.inner, params, **extra)
        if amp.amp.off and not skip_when_off:  # AMP off: inner as written
            return new_updates, opt_state._replace(inner=new_inner)
        # on a skip: updates of -0.0 (optax.apply_updates leaves every parameter bit for bit), the old inner state
        applied, skipped = (new_updates, new_inner), (skipped_updates(new_updates), opt_state.inner)
        (new_updates, new_inner), new_state, check = decide(opt_state, found, grads, applied, skipped,
                                                            caller="jaxamp.optimizer", axis_name=axis_name)
        new_state = new_state._replace(inner=new_inner)
        _report_stall(new_state, check, limit=max_consecutive_skips, on_stall=on_stall, caller="jaxamp.optimizer")
        return new_updates, new_state

    return AmpOptimizer(init_fn, update_fn)


def check_like_params(grads: Any, params: Any, caller: str) -> None:
    """Raise unless ``grads`` has ``params``' leaves (None for a module's non-array ones): a slip of argnums."""
    none_leaf = lambda x: x is None  # noqa: E731
    got = jax.tree_util.tree_structure(grads, is_leaf=none_leaf)
    want = jax.tree_util.tree_structure(params, is_leaf=none_leaf)
    if params is not None and got.num_leaves != want.num_leaves:
        raise TypeError(f"{caller}: the gradients have {got.num_leaves} leaves but `params` has {want.num_leaves}: "
                        "were they taken with respect to another argument (e.g. value_and_grad(loss, argnums=1))? "
                        "Fix: differentiate the parameters, jaxamp.value_and_grad(loss)(opt_state, params, batch).")
