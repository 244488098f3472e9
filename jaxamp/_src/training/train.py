"""`TrainState` and `make_train_step`: :func:`jaxamp.value_and_grad` and :func:`jaxamp.optimizer`
as one skip-on-overflow step, with metrics.

The step runs the user's step path itself: ``value_and_grad`` on the optimizer's state, then the
optimizer's ``update`` (which decides, selects and advances every scaler, and reports a stall).
A :class:`TrainState` holds the step count, the parameters and that optimizer's state, the one
home of the AMP state (``state.opt_state.amp``, also ``state.amp_state``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._src.scaling.config import AmpConfig, check_flags
from jaxamp._src.derivatives.engine import Derivatives
from jaxamp._src.training.optim import AmpOptimizer, optimizer as amp_optimizer, value_and_grad
from jaxamp._src.scaling.scaler import exact_log2
from jaxamp._src.training.start import init
from jaxamp._src.scaling.state import AmpState
from jaxamp._src.training.flags import flag_set
from jaxamp._src.training.monitor import STALL_LIMIT
from jaxamp._src.training.step import AmpOptState, SkipReason, StepFlags

__all__ = ["Step", "TrainState", "step_metrics", "AUX_CONTRACT", "torch_clip", "make_train_step"]

Step = Callable[["TrainState", Any], Tuple["TrainState", Dict[str, jax.Array]]]


class TrainState(NamedTuple):
    """Everything a training run carries from step to step. A pytree of arrays only.

    Attributes:
      step: ``i32[]``, steps taken, applied or skipped. params: the parameters (float32 pytree).
      opt_state: the state of :func:`jaxamp.optimizer` around the step's optax optimizer (an
        :class:`~jaxamp._src.training.step.AmpOptState`): the optax state (``.inner``), every scaler (``.amp``,
        an :class:`~jaxamp.AmpState`), the last step's reason and the skips in a row.
    """

    step: jax.Array
    params: Any
    opt_state: AmpOptState

    @property
    def amp_state(self) -> AmpState:
        """Every scaler: the optimizer state's :class:`~jaxamp.AmpState` (its one home)."""
        return self.opt_state.amp

    @property
    def consecutive_skips(self) -> jax.Array:
        """``i32[]``, steps skipped in a row (for the stall report)."""
        return self.opt_state.consecutive_skips

    def replace_amp(self, amp_state: AmpState) -> "TrainState":
        """This state with its AMP state replaced (e.g. scales restarted from a profile)."""
        return self._replace(opt_state=self.opt_state._replace(amp=amp_state))

    @classmethod
    def create(
        cls, *, params: Any, optimizer: optax.GradientTransformation, amp: AmpConfig,
        engines: Iterable[Derivatives] = (), amp_state: Optional[AmpState] = None,
    ) -> "TrainState":
        """The initial state.

        Args:
          params, optimizer, amp: the parameters, the step's optax transformation, the settings.
          engines: every derivative engine the loss uses: one derivative scaler per key of theirs.
          amp_state: the scalers, from ``jaxamp.init(loss_fn, amp)(params, batch)``; None: one
            scaler per key of ``engines``, at its configured start.

        Returns:
          A state at step 0 (loss scale 1 and no derivative scalers where those are inactive).

        Example:
          >>> import jax.numpy as jnp, optax, jaxamp
          >>> from jaxamp import TrainState
          >>> amp, params = jaxamp.AmpConfig(dtype="float16"), {"w": jnp.float32(1.0)}
          >>> engine = jaxamp.Derivatives(lambda p, x: p["w"] * jnp.sin(x), inputs=("x",), outputs=("u",),
          ...                             derivatives=("u__x__x",), amp=amp)
          >>> state = TrainState.create(params=params, optimizer=optax.adam(1e-3), amp=amp, engines=[engine])
          >>> int(state.step), sorted(state.scales), float(state.amp_state.loss_scale)
          (0, ['1', '2'], 65536.0)
          >>> loss_fn = lambda p, points: jnp.mean(engine(p, points)["u__x__x"] ** 2)
          >>> started = jaxamp.init(loss_fn, amp)(params, {"x": jnp.linspace(0.0, 1.0, 8)})
          >>> state = TrainState.create(params=params, optimizer=optax.adam(1e-3), amp=amp, amp_state=started)
          >>> sorted(state.scales)
          ['1', '2']
        """
        if not isinstance(amp, AmpConfig):
            raise TypeError(f"TrainState.create: `amp`={amp!r} must be an AmpConfig.")
        if isinstance(optimizer, AmpOptimizer):
            raise TypeError("TrainState.create: `optimizer` is a jaxamp.optimizer(...); pass the optax optimizer it "
                            "wraps: make_train_step wraps it itself (TrainState.opt_state is its state).")
        keys = {}
        for e in engines:
            if not isinstance(e, Derivatives):
                raise TypeError(f"TrainState.create: `engines` must hold jaxamp.Derivatives engines, got {e!r}.")
            if e.scaler_keys and not amp.scaler_enabled:
                raise ValueError(
                    f"TrainState.create: engine {e!r} has derivative scaler keys {list(e.scaler_keys)} but "
                    f"`amp` has no derivative scalers (enabled={amp.enabled}, dtype={amp.dtype!r}, "
                    f"derivative_scaling={amp.derivative_scaling}); build the engines with the same amp."
                )
            keys.update(dict.fromkeys(e.scaler_keys))
        if amp_state is None:
            amp_state = init(None, amp, keys=tuple(keys))()
        elif not isinstance(amp_state, AmpState):
            raise TypeError(f"TrainState.create: `amp_state`={amp_state!r} must be None or the AmpState of "
                            "jaxamp.init(loss_fn, amp)(...).")
        elif amp_state.amp != amp:
            raise ValueError(f"TrainState.create: `amp_state` was created with another AmpConfig ({amp_state.amp!r}) "
                             f"than `amp` ({amp!r}); create it with jaxamp.init(loss_fn, amp)(...).")
        elif missing := [k for k in keys if k not in amp_state.scales]:
            raise KeyError(f"TrainState.create: `amp_state` has no scaler for the engines' key(s) {missing}; it "
                           f"has {sorted(amp_state.scales)}. Create it with jaxamp.init of the loss that uses them.")
        return cls(step=jnp.asarray(0, jnp.int32), params=params,
                   opt_state=AmpOptState.start(optimizer.init(params), amp_state))

    @property
    def scales(self) -> Dict[str, jax.Array]:
        """``{key: f32[]}``: the current derivative scales, as a loss function takes them."""
        return self.amp_state.scales


def step_metrics(loss: jax.Array, terms: Any, flags: StepFlags, opt_state: AmpOptState, grad_norm: jax.Array,
                 extra: Optional[Mapping[str, jax.Array]] = None) -> Dict[str, jax.Array]:
    """The metrics of one step, as :func:`make_train_step` reports them (for users' own loops).

    Args:
      loss: the unscaled loss. terms: ``{name: f32[]}``.
      flags: the step's :class:`~jaxamp._src.training.step.StepFlags`.
      opt_state: the state of :func:`jaxamp.optimizer` after the step.
      grad_norm: the global norm of the unscaled gradients (0 when a flag is set: they are zeroed).
      extra: ``{name: f32[]}`` more metrics, reported under their names (not the step's own).

    Returns:
      ``{"loss", "skipped", "skip_reason", "consecutive_skips", "found_nonfinite_values",
      "grad_norm", "terms/<name>", "scale_log2/loss", "scale_log2/<key>", "found_inf/<key>": array}``
      and ``extra``'s names.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from jaxamp._src.training.step import StepFlags
      >>> from jaxamp._src.training.train import step_metrics
      >>> amp_state = jaxamp.init(None, jaxamp.AmpConfig(dtype="float16"), keys=["2"])()
      >>> tx = jaxamp.optimizer(optax.sgd(0.1), amp_state=amp_state)
      >>> grads, flags = {"w": jnp.ones(2)}, StepFlags({"2": jnp.bool_(False)}, source="optimizer")
      >>> opt_state = tx.update(grads, tx.init({"w": jnp.ones(2)}), flags=flags)[1]
      >>> metrics = step_metrics(jnp.float32(0.5), {"pde": jnp.float32(0.5)}, flags, opt_state, optax.tree.norm(grads))
      >>> sorted(metrics)  # doctest: +NORMALIZE_WHITESPACE
      ['consecutive_skips', 'found_inf/2', 'found_nonfinite_values', 'grad_norm', 'loss', 'scale_log2/2',
       'scale_log2/loss', 'skip_reason', 'skipped', 'terms/pde']
    """
    amp, reason = opt_state.amp, opt_state.skip_reason
    metrics = {"loss": loss, "skipped": reason != int(SkipReason.APPLIED), "skip_reason": reason,
               "consecutive_skips": opt_state.consecutive_skips,
               # bad values take precedence over every other reason: the flag is set iff that is the reason
               "found_nonfinite_values": reason == int(SkipReason.NONFINITE_VALUES), "grad_norm": grad_norm,
               **{f"terms/{k}": v for k, v in terms.items()},
               "scale_log2/loss": exact_log2(amp.loss.scale),
               **{f"scale_log2/{k}": exact_log2(s.scale) for k, s in amp.derivative.items()},
               **{f"found_inf/{k}": flag_set(flags.found_inf.get(k, False)) for k in amp.derivative}}
    clash = sorted(k for k in (extra or {}) if k in metrics)
    if clash:
        raise ValueError(f"step_metrics: the loss function's metric name(s) {clash} are not allowed: the step "
                         f"reports them itself ({sorted(metrics)}); rename them (e.g. 'my/{clash[0]}').")
    return {**metrics, **(extra or {})}


AUX_CONTRACT = (
    "loss_fn(params, batch) must return (loss, terms) or (loss, (terms, metrics)): terms a dict {name: scalar} of "
    "loss terms to report (may be empty), metrics a dict {name: scalar} of extra metrics; the derivative "
    "flags (and with headroom=True each key's headroom) are collected by the step. Example: "
    'return pde + bc, {"pde": pde, "bc": bc}'
)


def _split_aux(aux: Any) -> Tuple[Mapping[str, jax.Array], Mapping[str, jax.Array]]:
    """``(terms, metrics)`` from a loss function's aux, or a TypeError showing the contract."""
    if isinstance(aux, Mapping):
        terms, metrics = aux, {}
    elif isinstance(aux, (tuple, list)) and len(aux) == 2 and all(isinstance(a, Mapping) for a in aux):
        terms, metrics = aux
    else:
        what = f"a {type(aux).__name__} of length {len(aux)}" if isinstance(aux, (tuple, list)) else repr(aux)
        raise TypeError(f"make_train_step: loss_fn returned the aux {what}; {AUX_CONTRACT}.")
    for group, tree in (("term", terms), ("metric", metrics)):
        for name, v in tree.items():
            if not isinstance(name, str) or jnp.shape(v) != () or jnp.result_type(v) == jnp.bool_:
                raise TypeError(
                    f"make_train_step: loss_fn returned the {group} {name!r} of shape {jnp.shape(v)} and dtype "
                    f"{jnp.result_type(v)}: terms and metrics must map names (str) to numeric scalars (shape ()); "
                    f"a dict of flags is the found_inf of an old loss, which the step now collects itself. "
                    f"{AUX_CONTRACT}."
                )
    return terms, metrics


def torch_clip(max_norm: float) -> optax.GradientTransformation:
    """torch's ``clip_grad_norm_``: updates times ``min(max_norm / (norm + 1e-6), 1)``."""

    def update(updates: Any, state: Any, params: Any = None) -> Tuple[Any, Any]:
        coef = jnp.minimum(jnp.float32(max_norm) / (optax.tree.norm(updates) + jnp.float32(1e-6)), 1.0)
        return jax.tree_util.tree_map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_train_step(
    loss_fn: Callable[[Any, Any], Tuple[jax.Array, Any]], optimizer: optax.GradientTransformation, *,
    amp: Optional[AmpConfig] = None, grad_clip_max_norm: Optional[float] = None, merge: bool = True,
    headroom: bool = False, max_consecutive_skips: int = STALL_LIMIT, on_stall: Optional[str] = None,
) -> Step:
    """A pure ``step(state, batch) -> (state, metrics)``; ``jax.jit`` it.

    The step is :func:`jaxamp.value_and_grad` on ``state.opt_state``, then
    ``jaxamp.optimizer(optimizer).update`` on the (clipped) gradients: the same path as a user's step.

    Args:
      loss_fn: ``loss_fn(params, batch) -> (loss, terms)`` or ``(loss, (terms, metrics))``, its
        derivatives by :class:`jaxamp.Derivatives` engines (or :func:`jaxamp.grad` and its
        siblings); ``terms`` and ``metrics`` ``{name: f32[]}`` are reported.
      optimizer: any optax transformation (not yet wrapped); its schedule counts *applied* updates only.
      amp: the settings the state must have been created with (None: not checked).
      grad_clip_max_norm: torch's ``clip_grad_norm_`` of the unscaled gradients; None or 0: none.
      merge: as :func:`jaxamp.scaled` (the default of :func:`jaxamp.value_and_grad`).
      headroom: also report ``headroom_log2/<key>`` (``StepFlags.headroom_log2``).
      max_consecutive_skips, on_stall: as :func:`jaxamp.optimizer`, but ``on_stall`` None by default:
        the metrics carry ``consecutive_skips`` for a host-side :class:`jaxamp.StallMonitor`
        (as the examples feed one), with no callback in the step; ``"warn"``/``"raise"``: in the step.

    Returns:
      The step: the update applied or skipped, every scaler advanced, metrics (:func:`step_metrics`).

    Example (``u'' + u = 0`` for ``u = w sin(x)``):
      >>> import jax, jax.numpy as jnp, optax, jaxamp
      >>> amp = jaxamp.AmpConfig(dtype="float16")
      >>> engine = jaxamp.Derivatives(lambda p, x: p["w"] * jnp.sin(x), inputs=("x",), outputs=("u",),
      ...                             derivatives=("u__x__x",), amp=amp)
      >>> def loss_fn(params, batch):
      ...     values = engine(params, batch)
      ...     pde = jnp.mean((values["u__x__x"] + values["u"]) ** 2)
      ...     return pde, {"pde": pde}
      >>> state = jaxamp.TrainState.create(params={"w": jnp.float32(1.0)}, optimizer=optax.adam(1e-3),
      ...                                        amp=amp, engines=[engine])
      >>> step = jax.jit(jaxamp.make_train_step(loss_fn, optax.adam(1e-3), amp=amp))
      >>> state, metrics = step(state, {"x": jnp.linspace(0.0, 1.0, 8)})
      >>> int(state.step), bool(metrics["skipped"]), float(metrics["scale_log2/loss"])
      (1, False, 16.0)
    """
    clip = 0.0 if grad_clip_max_norm is None else grad_clip_max_norm
    bad_clip = isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0
    for bad, error, what in (  # checked in this order; the first bad argument raises
        (not callable(loss_fn), TypeError, f"`loss_fn`={loss_fn!r} must be callable as loss_fn(params, batch)"),
        (amp is not None and not isinstance(amp, AmpConfig), TypeError, f"`amp`={amp!r} must be an AmpConfig"),
        (not (hasattr(optimizer, "init") and hasattr(optimizer, "update")), TypeError,
         f"`optimizer`={optimizer!r} must be an optax GradientTransformation"),
        (isinstance(optimizer, AmpOptimizer), TypeError, "`optimizer` is a jaxamp.optimizer(...): pass the optax "
         "optimizer it wraps (the step wraps it itself, with max_consecutive_skips and on_stall)"),
        (bad_clip, ValueError, f"`grad_clip_max_norm`={grad_clip_max_norm!r} is not allowed: expected None or a "
         "finite number >= 0 (None or 0: no clipping)")):
        if bad:
            raise error(f"make_train_step: {what}.")
    check_flags("make_train_step", merge=merge, headroom=headroom)
    grad_fn = value_and_grad(loss_fn, has_aux=True, merge=merge, headroom=headroom)
    tx = amp_optimizer(optimizer, max_consecutive_skips=max_consecutive_skips, on_stall=on_stall, skip_when_off=True)

    def step(state: TrainState, batch: Any) -> Tuple[TrainState, Dict[str, jax.Array]]:
        amp_state = getattr(state.opt_state, "amp", None)
        if not isinstance(amp_state, AmpState) or (amp is not None and amp_state.amp != amp):
            raise ValueError(f"make_train_step: the state's `amp_state` ({amp_state!r}) was not created with the "
                             f"step's `amp` ({amp!r}); create the state with TrainState.create(..., amp=amp).")
        opt_state = state.opt_state
        (loss, aux), grads, flags = grad_fn(opt_state, state.params, batch)
        terms, extra = _split_aux(aux)
        grad_norm = optax.tree.norm(grads)
        if clip > 0:
            grads = torch_clip(clip).update(grads, None)[0]
        updates, after = tx.update(grads, opt_state, state.params, flags=flags)
        # a skipped step's updates are -0.0 (jaxamp.optimizer): the params stay bit for bit
        params = optax.apply_updates(state.params, updates)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=after)
        if headroom:
            extra = {**{f"headroom_log2/{k}": v for k, v in flags.headroom_log2.items()}, **extra}
        return new_state, step_metrics(loss, terms, flags, after, grad_norm, extra)

    return step
