"""The step decision of a mixed-precision train step (docs/algorithm.md, "Training step"), top to bottom:

1. the flags :func:`jaxamp.value_and_grad` reports beside the gradients (:class:`StepFlags`);
2. the check: apply or skip, and why (:func:`check_step`, a :class:`StepCheck` and its :class:`SkipReason`);
3. the selects of the applied or the kept values (:meth:`StepCheck.select`);
4. the scaler updates (:func:`update_scalers`);
5. the new state: the :class:`~jaxamp.AmpState` advanced, an optimizer state's (:class:`AmpOptState`) reason
   and skip count (:func:`after_step`);

and :func:`decide`, the five in that order, which :func:`jaxamp.apply_or_skip` and :func:`jaxamp.optimizer`
call. Every branch is a select: no host synchronisation, one compilation. Where the AMP state lives in a
user's state (:func:`locate`) closes the module.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union

import jax
import jax.numpy as jnp
import jmp

from jaxamp._src.core.marks import NONFINITE_VALUES
from jaxamp._src.scaling.scaler import DynamicScaler, Scalers, ScaleState
from jaxamp._src.scaling.state import AmpState, find
from jaxamp._src.training.flags import finite_both, flag_set

__all__ = ["Flags", "SkipReason", "StepFlags", "found_inf_of", "StepCheck", "check_step", "update_scalers",
           "AmpOptState", "after_step", "Decision", "decide", "decision", "in_one_kernel", "find_opt_state",
           "with_opt_state", "replace_amp", "locate"]

T = TypeVar("T")
Flags = Mapping[str, jax.Array]


# 1. The flags.


class SkipReason(enum.IntEnum):
    """Why a step was skipped (``metrics["skip_reason"]``, ``AmpOptState.skip_reason``), an ``int``
    enum to compare with the ``i32`` arrays.

    Example:
      >>> from jaxamp import SkipReason
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


def found_inf_of(flags: Union[StepFlags, Flags], caller: str) -> Dict[str, Any]:
    """The ``{key: flag}`` a step decides on: a :class:`StepFlags`' ``found_inf``, or such a dict
    itself (e.g. the ``found_inf`` of ``jaxamp.scaled(jax.jacrev(losses))``)."""
    if isinstance(flags, StepFlags):
        return flags.found_inf
    if isinstance(flags, dict):
        return flags
    raise TypeError(f"{caller}: `flags` must be the StepFlags of jaxamp.value_and_grad (loss, grads, flags = "
                    f"jaxamp.value_and_grad(loss)(state, params, ...)) or the found_inf dict of jaxamp.scaled, got "
                    f"{type(flags).__name__}.")


# 2. The check, 3. the selects.


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
        the same structure. A select per leaf, not a blend (inf/NaN in the unselected tree never
        leak), nor a ``lax.cond`` (which copies every leaf in its branches: a kernel per leaf on a
        GPU, docs/gpu.md): XLA fuses each select into the kernel computing its leaf.

        Example:
          >>> import jax.numpy as jnp, jaxamp
          >>> from jaxamp._src.training.step import check_step
          >>> scalers = jaxamp.init(None, jaxamp.AmpConfig(dtype="float16"), keys=["2"])().derivative
          >>> check = check_step(scalers, {"2": jnp.array(True)}, {"w": jnp.ones(2)})
          >>> check.select({"w": jnp.full(2, jnp.nan)}, {"w": jnp.ones(2)})  # skipped: the old params
          {'w': Array([1., 1.], dtype=float32)}
        """
        return jmp.select_tree(self.apply, applied, skipped)


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
      >>> from jaxamp._src.training.step import check_step
      >>> scalers = jaxamp.init(None, jaxamp.AmpConfig(dtype="float16"), keys=["1", "2"])().derivative
      >>> found_inf = {"1": jnp.array(False), "2": jnp.array(True), "nonfinite_values": jnp.array(False)}
      >>> check = check_step(scalers, found_inf, {"w": jnp.ones(2)})
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
    # a chain of ORs, not a reduction of its own: XLA fuses it into its two consumers (the decision
    # below and the scalars' kernel, in_one_kernel), each a kernel anyway
    overflow = functools.reduce(jnp.logical_or, flags.values(), jnp.bool_(False))
    applied = jnp.where(new_finite, int(SkipReason.APPLIED), int(SkipReason.NONFINITE_UPDATES))
    unscaled = jnp.where(finite, applied, int(SkipReason.NONFINITE_GRADS))
    reason = jnp.where(values, int(SkipReason.NONFINITE_VALUES),
                       jnp.where(overflow, int(SkipReason.DERIVATIVE_OVERFLOW), unscaled))
    skip, updates = decision([[values, overflow, ~finite, ~new_finite], [reason == int(SkipReason.NONFINITE_UPDATES)]])
    return StepCheck(apply=~skip, skip_reason=reason.astype(jnp.int32), found_inf=flags,
                     nonfinite_values=values, derivative_overflow=overflow, grads_finite=finite,
                     nonfinite_updates=updates)


def decision(rows: Sequence[Sequence[jax.Array]]) -> Tuple[jax.Array, ...]:
    """``any`` of each row of bools, as one reduction with a vector result (one ``bool[]`` per row,
    slices of it).

    The step's decision is read by every select of the step, fused into the kernels computing the
    optimizer's new values. XLA merges sibling kernels of one shape into one only over a shared
    operand that is an array, never over a scalar one: with the decision a ``bool[2]`` (at least two
    rows), the new values of every leaf of one shape are one kernel (H100 program, 4x512/6000: 9
    kernels for the Adam updates of 10 leaves become 3; docs/gpu.md). A reduction over stacked
    scalars, not a chain of ORs: XLA would fuse such a chain into each consumer, the vector gone.
    """
    if len(rows) < 2:
        raise ValueError(f"decision: {len(rows)} row(s); at least 2 keep the result a vector (see the docstring).")
    width = max(len(r) for r in rows)
    false = jnp.bool_(False)
    table = jnp.stack([jnp.stack([jnp.asarray(b, bool).reshape(()) for b in r] + [false] * (width - len(r)))
                       for r in rows])
    # the conversion keeps XLA from rewriting the reduction of stacked scalars into ORs (as any_set)
    out = jnp.any(table.astype(jnp.uint8) != 0, axis=1)
    return tuple(out[i] for i in range(len(rows)))


# 4. The scaler updates.


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
      >>> from jaxamp._src.training.step import check_step, update_scalers
      >>> amp = jaxamp.AmpConfig(dtype="float16")
      >>> state = jaxamp.init(None, amp, keys=["1", "2"])()
      >>> scalers, loss_scale = state.derivative, state.loss
      >>> check = check_step(scalers, {"2": jnp.array(True)}, {"w": jnp.ones(2)})
      >>> scalers, loss_scale = update_scalers(scalers, loss_scale, amp.make_loss_scaler(), check)
      >>> {k: float(v) for k, v in scalers.scales.items()}, float(loss_scale.scale)
      ({'1': 1.0, '2': 0.5}, 65536.0)
    """
    if not isinstance(scalers, Scalers):
        raise TypeError(f"update_scalers: `scalers` must be a jaxamp._src.scaling.scaler.Scalers (jaxamp.init "
                        f"pairs each key with its rule), got {type(scalers).__name__}.")
    frozen = check.nonfinite_values | check.nonfinite_updates
    scalers = jmp.select_tree(frozen, scalers, scalers.update(check.found_inf))
    if loss_rule is not None:
        stepped = loss_rule.update(loss_scale, ~check.grads_finite)
        loss_scale = jmp.select_tree(frozen | check.derivative_overflow, loss_scale, stepped)
    return scalers, loss_scale


# 5. The new state.


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


def _is_opt(x: Any) -> bool:
    return isinstance(x, AmpOptState)


def find_opt_state(tree: Any) -> Optional[AmpOptState]:
    """The one :class:`AmpOptState` in ``tree`` (an optimizer state, e.g. of ``optax.chain``), or None."""
    found = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_opt) if _is_opt(x)]
    return found[0] if len(found) == 1 else None


def with_opt_state(tree: Any, opt: AmpOptState) -> Any:
    """``tree`` with its one :class:`AmpOptState` replaced by ``opt``."""
    return jax.tree_util.tree_map(lambda x: opt if _is_opt(x) else x, tree, is_leaf=_is_opt)


def replace_amp(tree: Any, amp: AmpState) -> Any:
    """``tree`` with its one :class:`~jaxamp.AmpState` replaced by ``amp``."""
    is_amp = lambda x: isinstance(x, AmpState)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: amp if is_amp(x) else x, tree, is_leaf=is_amp)


def after_step(state: Any, amp: AmpState, check: StepCheck) -> Any:
    """``state`` (of its own type) after the step ``check`` decided, its AMP state ``amp``: a bare
    :class:`~jaxamp.AmpState` is ``amp``; an optimizer state's :class:`AmpOptState` also takes the
    step's reason and counts the skips in a row; any other tree holding one ``AmpState`` has it replaced."""
    if isinstance(state, AmpState):
        return amp
    opt = find_opt_state(state)
    if opt is None:
        return replace_amp(state, amp)
    count = jnp.where(check.apply, 0, jnp.asarray(opt.consecutive_skips, jnp.int32) + 1).astype(jnp.int32)
    return with_opt_state(state, AmpOptState(opt.inner, amp, check.skip_reason, count))


class Decision(NamedTuple):
    """What :func:`decide` returns."""

    chosen: Any  # the applied values, or the skipped ones
    state: Any  # the state after the step, of the given state's type
    check: StepCheck  # the decision


def decide(state: Any, found_inf: Flags, grads: Any, applied: T, skipped: T, *, caller: str,
           axis_name: Optional[Any] = None) -> Decision:
    """One step's decision, whole: the check of the flags, the gradients and the new values
    (:func:`check_step`), the select of ``applied`` or ``skipped``, every scaler updated
    (:func:`update_scalers`) and the new state (:func:`after_step`).

    Args:
      state: a bare :class:`~jaxamp.AmpState`, or a tree holding one (an optimizer state).
      found_inf: the step's flags (:func:`found_inf_of`).
      grads: the unscaled weight gradients, or None for flags without gradients: then the loss
        scaler does not move (nothing loss-scaled was checked).
      applied, skipped: pytrees of one structure: the new values (checked finite) and those kept on a skip.
      caller: the public function deciding, for errors.
      axis_name: inside ``pmap``/``shard_map``: OR the flags over this axis.
    """
    amp = find(state, caller)
    check = check_step(amp.derivative, found_inf, () if grads is None else grads, axis_name=axis_name, new=applied)
    chosen = check.select(applied, skipped)
    loss_rule = None if grads is None else amp.loss_rule
    derivative, loss = update_scalers(amp.derivative, amp.loss, loss_rule, check)
    new_state = after_step(state, amp.replace(derivative=derivative, loss=loss), check)
    return in_one_kernel(Decision(chosen, new_state, check))


def _lowest(dtype: Any) -> jax.Array:
    """The smallest value of ``dtype``: the identity of a maximum."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf, dtype)
    return jnp.array(jnp.iinfo(dtype).min, dtype)


def in_one_kernel(tree: T) -> T:
    """``tree`` with its one-element leaves computed together: the results of one instruction, a
    variadic maximum over pairs ``(x, lowest)``, which gives each ``x`` back bit for bit (NaN included,
    its derivative 1); one such instruction per floating dtype (an instruction mixes no two), the
    integers and bools with the first.

    A step's scalars (each scale, growth tracker, skip reason, skip count, an optimizer's count, a
    one-element layer's new values) are tiny computations with separate results; on a GPU XLA gives
    each its own kernel (it merges siblings only over a shared array operand, never over shared
    scalars). As one instruction's results they are one kernel, their arithmetic fused into it
    (H100 program, 4x512/6000: 10 kernels fewer; docs/gpu.md).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    groups: Dict[Any, list] = {}
    for i, x in enumerate(leaves):
        if hasattr(x, "dtype") and jnp.size(x) == 1:
            inexact = jnp.issubdtype(x.dtype, jnp.inexact)
            groups.setdefault(jnp.dtype(x.dtype) if inexact else None, []).append(i)
    ints = groups.pop(None, [])
    batches = [list(g) for g in groups.values()] or [[]]
    batches[0] += ints
    for picked in batches:
        if len(picked) < 2:
            continue
        xs = [jnp.asarray(leaves[i]).reshape(()) for i in picked]
        xs = [x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x for x in xs]
        low = [_lowest(x.dtype) for x in xs]
        outs = jax.lax.reduce([jnp.stack([x, lo]) for x, lo in zip(xs, low)], low,
                              lambda a, b: [jax.lax.max(p, q) for p, q in zip(a, b)], (0,))
        for i, out in zip(picked, outs):
            leaves[i] = out.astype(leaves[i].dtype).reshape(jnp.shape(leaves[i]))
    return jax.tree_util.tree_unflatten(treedef, leaves)


# Where the AMP state lives in the user's state.


def _inside_stateful(node: Any) -> bool:
    """Whether ``node`` holds the :class:`AmpOptState` inside an optax state (a tuple or NamedTuple:
    ``optax.chain``'s, ``MultiSteps``') beside arrays of that state's own. Other containers (a Flax
    TrainState, an ``nnx.Optimizer``, a dict) are looked through."""

    def holds(x: Any) -> bool:
        return any(_is_opt(y) for y in jax.tree_util.tree_leaves(x, is_leaf=_is_opt))

    def arrays(x: Any) -> bool:
        return any(hasattr(y, "shape") for y in jax.tree_util.tree_leaves(x, is_leaf=_is_opt) if not _is_opt(y))

    if _is_opt(node) or not holds(node):
        return False
    kids = jax.tree_util.tree_leaves(node, is_leaf=lambda x: x is not node)  # one level down
    if isinstance(node, tuple) and any(arrays(k) for k in kids if not holds(k)):
        return True
    return any(_inside_stateful(k) for k in kids if holds(k))


def locate(state: Any, caller: str) -> Tuple[AmpState, str]:
    """The AMP state the step runs with, and ``"optimizer"`` or ``"amp_state"``: where it came from.

    An optimizer state whose :class:`AmpOptState` sits inside another transformation's state
    holding arrays (``optax.chain(jaxamp.optimizer(a), b)`` with a stateful ``b``,
    ``optax.MultiSteps(jaxamp.optimizer(a))``) is refused: that state would move on a skipped step
    (or see only some of the flags); ``jaxamp.optimizer`` wraps the whole optimizer."""
    opt = find_opt_state(state) if not isinstance(state, AmpState) else None
    if opt is not None and opt.amp is None:
        raise TypeError(f"{caller}: the optimizer's state has no AmpState yet (built by jaxamp.optimizer(inner) "
                        "without one); set it once: opt_state = jaxamp._src.training.optim.with_amp_state(opt_state, "
                        "jaxamp.init(loss, amp)(params, batch)), or build jaxamp.optimizer(inner, "
                        "amp_state=amp_state).")
    if opt is not None and _inside_stateful(state):
        raise TypeError(
            f"{caller}: `state` ({type(state).__name__}) holds jaxamp.optimizer's state inside another "
            "transformation's state that has arrays of its own (e.g. optax.chain(jaxamp.optimizer(a), b) with a "
            "stateful b, or optax.MultiSteps(jaxamp.optimizer(a))): that state would advance on skipped steps, or "
            "see only some steps' flags. Fix: wrap the whole optimizer, jaxamp.optimizer(optax.chain(a, b)) or "
            "jaxamp.optimizer(optax.MultiSteps(a, k)); stateless transformations (a clip) may stand outside.")
    return find(state, caller), ("optimizer" if opt is not None else "amp_state")
