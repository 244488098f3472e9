"""The pieces of a mixed-precision train step (docs/algorithm.md, "Training step"): gradients
(:func:`loss_scaled_grad`), the flags reported beside them (:class:`StepFlags`), the apply-or-skip
decision (:func:`check_step`), the scaler updates (:func:`update_scalers`) and the optimizer's
state (:class:`AmpOptState`). All branches are selects: no host synchronisation, one compilation.

The gradients are the plain tree of the parameters (zeroed when a flag is set, so a norm of them
stays finite); the flags reach the optimizer as its ``flags`` extra argument, the decision and
every scaler live in its state.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple, TypeVar

import jax
import jax.numpy as jnp
import jmp

from jaxamp._src.core.marks import NONFINITE_VALUES, any_set
from jaxamp._src.placement.held import held_operands
from jaxamp._src.scaling.config import check_flags
from jaxamp._src.training.flags import finite_both, flag_set, skipped_updates
from jaxamp._src.scaling.scaler import DynamicScaler, Scalers, ScaleState

__all__ = ["check_like_params", "Flags", "SkipReason", "StepFlags", "loss_scaled_grad", "StepCheck", "check_step", "update_scalers", "AmpOptState", "find_opt_state", "with_opt_state"]

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
    NONFINITE_UPDATES = 4  # finite gradients but non-finite new values (e.g. a NaN loss weight): no scaler moves


class StepFlags:
    """What :func:`jaxamp.value_and_grad` reports beside the gradients, for :func:`jaxamp.optimizer`
    (``update(grads, opt_state, params, flags=flags)``) and :func:`jaxamp.apply_or_skip`: the
    gradients stay the plain tree optax expects; the step's decision reads these.

    Attributes:
      found_inf: ``{key: bool[]}`` the derivative flags (``NONFINITE_VALUES`` included).
      headroom_log2: ``{key: f32[]}`` each key's headroom (``value_and_grad(headroom=True)``), else ``{}``.
      source: static: ``"optimizer"`` when computed from an optimizer state, else ``"amp_state"``.
    """

    __slots__ = ("found_inf", "headroom_log2", "source")

    def __init__(self, found_inf: Flags, headroom_log2: Optional[Dict[str, Any]] = None, *,
                 source: str = "amp_state") -> None:
        self.found_inf, self.source = dict(found_inf), source
        self.headroom_log2 = {} if headroom_log2 is None else dict(headroom_log2)

    def replace(self, **changes: Any) -> "StepFlags":
        """A copy with some attributes changed."""
        fields = {k: getattr(self, k) for k in self.__slots__}
        return StepFlags(**{**fields, **changes})

    def __repr__(self) -> str:
        return f"StepFlags(found_inf={self.found_inf!r}, source={self.source!r})"


jax.tree_util.register_pytree_with_keys(
    StepFlags,
    lambda s: (((jax.tree_util.GetAttrKey("found_inf"), s.found_inf),
                (jax.tree_util.GetAttrKey("headroom_log2"), s.headroom_log2)), s.source),
    lambda source, children: StepFlags(*children, source=source),
)


def loss_scaled_grad(fun: Callable[..., Tuple[jax.Array, Any]], argnums: Any, loss_scale: Optional[jax.Array],
                     held: bool = False) -> Callable[..., Tuple[Any, Tuple[jax.Array, Any]]]:  # fmt: skip
    """The gradients of ``fun``'s loss times ``loss_scale`` (float32), divided by it, as in
    :func:`jaxamp.value_and_grad`: float16 weight gradients that would underflow survive.

    Args:
      fun: ``fun(*args) -> (loss, aux)``.
      argnums: as ``jax.grad``.
      loss_scale: ``f32[]``, or None (loss scaling off: nothing multiplies).
      held: per-tensor scaled products take widened operands as they are held
        (:func:`jaxamp._src.placement.held.held_operands`: the cotangents of float16 activations).

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
        # the gradients written out as the backward pass made them, the unscale and the skip's
        # selects fused into their consumers: without it XLA fuses the gradients' last stage into
        # each consumer and keeps more of the backward pass live (H100 program, 4x512/6000: 33 MiB
        # more device temp memory, 9 kernels fewer; docs/gpu.md)
        grads = jax.lax.optimization_barrier(grads)
        return jax.tree_util.tree_map(lambda x: x * inv.astype(x.dtype), grads), out

    return held_operands(g) if held else g


class StepCheck(NamedTuple):
    """The apply-or-skip decision of one step (a pytree of scalars; see :func:`check_step`)."""

    apply: jax.Array  # bool[]: the update is applied
    skip_reason: jax.Array  # i32[]: a SkipReason
    found_inf: Dict[str, jax.Array]  # {scaler key: bool[]}: a true overflow under that key
    nonfinite_values: jax.Array  # bool[]: bad values (inputs, network outputs) somewhere
    derivative_overflow: jax.Array  # bool[]: some derivative scaler key overflowed
    grads_finite: jax.Array  # bool[]: the unscaled weight gradients are finite
    nonfinite_updates: jax.Array  # bool[]: skipped only for non-finite new values (no scaler moves)

    def select(self, applied: T, skipped: T) -> T:
        """``applied`` where the step applies, else ``skipped``, leaf by leaf, for any pytrees of
        the same structure. A select, not a blend: inf/NaN in the unselected tree never leak.

        Example:
          >>> import jax.numpy as jnp, jaxamp
          >>> scalers = jaxamp.init(None, jaxamp.AmpConfig(dtype="float16"), keys=["2"])().derivative
          >>> check = jaxamp.step.check_step(scalers, {"2": jnp.array(True)}, {"w": jnp.ones(2)})
          >>> check.select({"w": jnp.full(2, jnp.nan)}, {"w": jnp.ones(2)})  # skipped: the old params
          {'w': Array([1., 1.], dtype=float32)}
        """
        return jmp.select_tree(self.apply, applied, skipped)

    def keep(self, updates: T, new_inner: Any, old_inner: Any) -> Tuple[T, Any]:
        """An optimizer's outputs after the decision: ``updates``, or on a skip ``-0.0``
        (:func:`~jaxamp._src.training.flags.skipped_updates`: ``optax.apply_updates`` then leaves
        every parameter bit for bit), and the new inner state or the old one: selects per leaf,
        which XLA fuses into the kernels computing them (a ``lax.cond`` copies every leaf in its
        branches: a kernel per leaf on a GPU, docs/gpu.md)."""
        updates = self.select(updates, skipped_updates(updates))
        return updates, self.select(new_inner, old_inner)


def check_step(scalers: Mapping[str, Any], found_inf: Flags, grads: Any, *, axis_name: Optional[Any] = None,
               new: Any = None) -> StepCheck:
    """Decide whether a step applies, and why not.

    Precedence (docs/algorithm.md, "Training step"): bad values (``found_inf[NONFINITE_VALUES]``,
    which no scale cures) over a derivative overflow (which makes the gradients non-finite) over
    non-finite weight gradients over non-finite new values (``new``).

    Args:
      scalers: the derivative scalers (or any mapping with the same keys); a flag under any
        other key but ``NONFINITE_VALUES`` is an error.
      found_inf: ``{key: bool[]}`` from the derivative engines, ``NONFINITE_VALUES`` included
        (or encoded flags: any non-zero value is set).
      grads: the unscaled weight gradients (any pytree).
      new: the new values the step would apply (updates, new optimizer state, ...): non-finite
        ones skip the step as ``NONFINITE_UPDATES``; None: not checked.
      axis_name: inside ``pmap``/``shard_map``/``vmap``: OR the flags over this named axis.

    Returns:
      A :class:`StepCheck`.

    Example (flags as a derivative engine returns them: key ``"2"`` overflowed):
      >>> import jax.numpy as jnp, jaxamp
      >>> scalers = jaxamp.init(None, jaxamp.AmpConfig(dtype="float16"), keys=["1", "2"])().derivative
      >>> found_inf = {"1": jnp.array(False), "2": jnp.array(True), "nonfinite_values": jnp.array(False)}
      >>> check = jaxamp.step.check_step(scalers, found_inf, {"w": jnp.ones(2)})
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
    finite, new_finite = finite_both(grads, new)
    flags = {k: flag_set(found_inf.get(k, False)) for k in scalers}
    values = flag_set(found_inf.get(NONFINITE_VALUES, False))
    if axis_name is not None:
        reduce = lambda b: jax.lax.pmax(b.astype(jnp.int32), axis_name) > 0  # noqa: E731
        flags, values = {k: reduce(v) for k, v in flags.items()}, reduce(values)
        finite, new_finite = ~reduce(~finite), ~reduce(~new_finite)
    overflow = any_set(list(flags.values()))
    applied = jnp.where(new_finite, int(SkipReason.APPLIED), int(SkipReason.NONFINITE_UPDATES))
    reason = jnp.where(values, int(SkipReason.NONFINITE_VALUES), jnp.where(overflow, int(SkipReason.DERIVATIVE_OVERFLOW),
                       jnp.where(finite, applied, int(SkipReason.NONFINITE_GRADS))))
    # the decision every select of the step reads: one reduction, not the chain of selects above
    apply = ~any_set([values, overflow, ~finite, ~new_finite])
    return StepCheck(apply=apply, skip_reason=reason.astype(jnp.int32), found_inf=flags,
                     nonfinite_values=values, derivative_overflow=overflow, grads_finite=finite,
                     nonfinite_updates=reason == int(SkipReason.NONFINITE_UPDATES))


def update_scalers(
    scalers: Scalers, loss_scale: ScaleState, loss_rule: Optional[DynamicScaler], check: StepCheck
) -> Tuple[Scalers, ScaleState]:
    """The scaler updates after a step (docs/algorithm.md, "Training step"): on bad values (or
    non-finite new values) none moves; else every derivative scaler steps with its own flag, and
    unless a derivative overflowed the loss scaler steps with "gradients non-finite".

    Args:
      scalers, loss_scale, loss_rule: the derivative scalers, the loss scaler's state and rule
        (None: loss scaling off, no change). check: this step's :class:`StepCheck`.

    Returns:
      ``(scalers, loss_scale)`` after the step.

    Example (key ``"2"`` overflowed: it backs off, key ``"1"`` and the loss scale stay):
      >>> import jax.numpy as jnp, jaxamp
      >>> amp = jaxamp.AmpConfig(dtype="float16")
      >>> state = jaxamp.init(None, amp, keys=["1", "2"])()
      >>> scalers, loss_scale = state.derivative, state.loss
      >>> check = jaxamp.step.check_step(scalers, {"2": jnp.array(True)}, {"w": jnp.ones(2)})
      >>> scalers, loss_scale = jaxamp.step.update_scalers(scalers, loss_scale, amp.make_loss_scaler(), check)
      >>> {k: float(v) for k, v in scalers.scales.items()}, float(loss_scale.scale)
      ({'1': 1.0, '2': 0.5}, 65536.0)
    """
    if not isinstance(scalers, Scalers):
        raise TypeError(f"update_scalers: `scalers` must be a jaxamp.scaler.Scalers (jaxamp.init pairs each "
                        f"key with its rule), got {type(scalers).__name__}.")
    frozen = check.nonfinite_values | check.nonfinite_updates
    scalers = jmp.select_tree(frozen, scalers, scalers.update(check.found_inf))
    if loss_rule is not None:
        stepped = loss_rule.update(loss_scale, ~check.grads_finite)
        loss_scale = jmp.select_tree(frozen | check.derivative_overflow, loss_scale, stepped)
    return scalers, loss_scale



class AmpOptState(NamedTuple):
    """The state of :func:`jaxamp.optimizer`.

    Attributes:
      inner: the inner optimizer's state. amp: the :class:`~jaxamp.AmpState` (None until given).
      skip_reason: ``i32[]``, the last step's :class:`SkipReason` (0 when applied).
      consecutive_skips: ``i32[]``, steps skipped in a row up to the last one.
    """

    inner: Any
    amp: Any
    skip_reason: jax.Array
    consecutive_skips: jax.Array

    @classmethod
    def start(cls, inner: Any, amp: Any) -> "AmpOptState":
        """The state before the first step: ``inner`` (the inner optimizer's init), ``amp``, no skip."""
        zero = jnp.asarray(0, jnp.int32)
        return cls(inner, amp, zero, zero)


def find_opt_state(tree: Any) -> Optional[AmpOptState]:
    """The one :class:`AmpOptState` in ``tree`` (an optimizer state, e.g. of ``optax.chain``), or None."""
    found = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, AmpOptState))
             if isinstance(x, AmpOptState)]  # fmt: skip
    return found[0] if len(found) == 1 else None


def with_opt_state(tree: Any, opt: AmpOptState) -> Any:
    """``tree`` with its one :class:`AmpOptState` replaced by ``opt``."""
    is_opt = lambda x: isinstance(x, AmpOptState)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: opt if is_opt(x) else x, tree, is_leaf=is_opt)


def check_like_params(grads: Any, params: Any, caller: str) -> None:
    """Raise unless ``grads`` has ``params``' leaves (None for a module's non-array ones): a slip of argnums."""
    none_leaf = lambda x: x is None  # noqa: E731
    got = jax.tree_util.tree_structure(grads, is_leaf=none_leaf)
    want = jax.tree_util.tree_structure(params, is_leaf=none_leaf)
    if params is not None and got.num_leaves != want.num_leaves:
        raise TypeError(f"{caller}: the gradients have {got.num_leaves} leaves but `params` has {want.num_leaves}: "
                        "were they taken with respect to another argument (e.g. value_and_grad(loss, argnums=1))? "
                        "Fix: differentiate the parameters, jaxamp.value_and_grad(loss)(opt_state, params, batch).")
