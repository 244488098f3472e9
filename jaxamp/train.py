"""`TrainState` and the skip-on-overflow train step (SPEC.md, "One training step")."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from jaxamp.config import AmpConfig
from jaxamp.derivatives import Derivatives
from jaxamp.scaler import ScaleState, exact_log2
from jaxamp.tree import all_finite, any_true, select_tree

# loss_fn(params, batch, scales) -> (loss f32[], (terms {name: f32[]}, found_inf {key: bool[]}))
LossFn = Callable[..., Tuple[jax.Array, Tuple[Mapping[str, jax.Array], Mapping[str, jax.Array]]]]

# Why a step was skipped (metrics["skip_reason"]).
APPLIED, SKIP_DERIVATIVE_OVERFLOW, SKIP_NONFINITE_GRADS = 0, 1, 2


class TrainState(NamedTuple):
    """Everything a training run carries from step to step. A pytree of arrays only."""

    step: jax.Array  # i32[]: steps taken, applied or skipped
    params: Any  # pytree of f32 arrays
    opt_state: Any  # optax state of the optimizer given to make_train_step
    loss_scale: ScaleState  # weight-gradient loss scaler
    deriv_scales: Dict[str, ScaleState]  # one derivative scaler per key ("1", "2", "u__x", ...)

    @classmethod
    def create(
        cls,
        *,
        params: Any,
        optimizer: optax.GradientTransformation,
        amp: AmpConfig,
        engines: Iterable[Derivatives] = (),
    ) -> "TrainState":
        """Initial state: optimizer state, loss scaler and one derivative scaler per key used by
        ``engines``. With scalers inactive (AMP off, bf16, fp32) the loss scale is fixed at 1 and
        there are no derivative scalers."""
        if not isinstance(amp, AmpConfig):
            raise TypeError(f"TrainState.create: `amp`={amp!r} must be an AmpConfig.")
        engines = list(engines)
        for e in engines:
            if not isinstance(e, Derivatives):
                raise TypeError(f"TrainState.create: `engines` must hold Derivatives engines, got {e!r}.")
        deriv = {}
        for e in engines:
            deriv.update(e.init_scaler_states())
        if amp.loss_scaling_enabled:
            loss_scale = amp.make_loss_scaler().init()
        else:
            loss_scale = ScaleState(jnp.asarray(1.0, jnp.float32), jnp.asarray(0, jnp.int32))
        return cls(
            step=jnp.asarray(0, jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=loss_scale,
            deriv_scales=deriv,
        )

    @property
    def scales(self) -> Dict[str, jax.Array]:
        """``{key: f32[]}``: the current derivative scales, as a loss function takes them."""
        return {k: s.scale for k, s in self.deriv_scales.items()}


def clip_by_global_norm(grads: Any, max_norm: float) -> Tuple[Any, jax.Array]:
    """Scale ``grads`` by ``min(1, max_norm / (norm + 1e-6))`` (torch's ``clip_grad_norm_``).

    Returns the clipped tree and the global norm before clipping.
    """
    norm = optax.tree.norm(grads)
    coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(1e-6)), jnp.float32(1.0))
    return jax.tree_util.tree_map(lambda g: g * coef.astype(g.dtype), grads), norm


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    amp: AmpConfig,
    grad_clip_max_norm: Optional[float] = 0.5,
) -> Callable[[TrainState, Any], Tuple[TrainState, Dict[str, jax.Array]]]:
    """A pure ``step(state, batch) -> (state, metrics)`` in SPEC's order; ``jax.jit`` it.

    Args:
      loss_fn: ``loss_fn(params, batch, scales) -> (loss, (terms, found_inf))`` where
        ``scales`` is ``{key: f32[]}`` to pass to the derivative engines, ``terms`` a dict of
        loss terms to report and ``found_inf`` the merged flags of the engines
        (``{key: bool[]}``; use :func:`merge_found_inf` for several engines).
      optimizer: any optax transformation. Its schedule counts *applied* updates only
        (a skipped step leaves the optimizer state untouched), unlike Modulus, whose
        scheduler also advances on skipped steps.
      amp: the mixed-precision settings (scaler rules, which scalers are active).
      grad_clip_max_norm: global-norm clipping of the unscaled weight gradients (as torch's
        ``clip_grad_norm_``); ``0`` or ``None`` disables it.

    The step: (1) loss and derivatives with per-key overflow flags; (2) gradients of
    ``loss * loss_scale``; (3) any derivative overflow skips the update: params, optimizer
    state and loss scaler are returned unchanged; (4) otherwise the unscaled gradients, if
    finite, are clipped and applied and the loss scaler counts a clean step; if not, the
    update is skipped and the loss scaler backs off; (5) every derivative scaler updates with
    its own flag. All branches are ``jnp.where`` selects: no host sync, no recompilation.
    """
    if not isinstance(amp, AmpConfig):
        raise TypeError(f"make_train_step: `amp`={amp!r} must be an AmpConfig.")
    if grad_clip_max_norm is None:
        grad_clip_max_norm = 0.0
    if (
        isinstance(grad_clip_max_norm, bool)
        or not isinstance(grad_clip_max_norm, (int, float))
        or not math.isfinite(grad_clip_max_norm)
        or grad_clip_max_norm < 0
    ):
        raise ValueError(
            f"make_train_step: `grad_clip_max_norm`={grad_clip_max_norm!r} must be a finite number >= 0 "
            "(0 or None disables clipping)."
        )
    loss_rule = amp.make_loss_scaler() if amp.loss_scaling_enabled else None

    def step(state: TrainState, batch: Any) -> Tuple[TrainState, Dict[str, jax.Array]]:
        scales = state.scales
        loss_scale = state.loss_scale.scale

        def scaled_loss(params):
            loss, (terms, found_inf) = loss_fn(params, batch, scales)
            return loss.astype(jnp.float32) * loss_scale, (loss, terms, found_inf)

        scaled_grads, (loss, terms, found_inf) = jax.grad(scaled_loss, has_aux=True)(state.params)
        unknown = [k for k in found_inf if k not in state.deriv_scales]
        if unknown:
            raise KeyError(
                f"make_train_step: loss_fn reported found_inf for scaler key(s) {unknown} that the "
                f"TrainState has no scaler for (it has {sorted(state.deriv_scales)}). Create the state "
                "with TrainState.create(..., engines=[every engine the loss uses])."
            )
        found_inf = {k: jnp.asarray(found_inf.get(k, False), bool) for k in state.deriv_scales}
        deriv_overflow = any_true(found_inf)

        # (4) unscale in f32, check, clip, update.
        inv_scale = jnp.float32(1.0) / loss_scale
        grads = jax.tree_util.tree_map(lambda g: g * inv_scale.astype(g.dtype), scaled_grads)
        grads_finite = all_finite(grads)
        if grad_clip_max_norm > 0:
            grads, grad_norm = clip_by_global_norm(grads, grad_clip_max_norm)
        else:
            grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        apply = jnp.logical_and(~deriv_overflow, grads_finite)
        params = select_tree(apply, new_params, state.params)
        opt_state = select_tree(apply, new_opt_state, state.opt_state)

        if loss_rule is not None:
            stepped = loss_rule.update(state.loss_scale, ~grads_finite)
            new_loss_scale = select_tree(deriv_overflow, state.loss_scale, stepped)
        else:
            new_loss_scale = state.loss_scale

        # (5) every derivative scaler with its own flag, skipped step or not.
        deriv_scales = {
            k: amp.derivative_scaler_for(k).update(s, found_inf[k]) for k, s in state.deriv_scales.items()
        }

        reason = jnp.where(
            deriv_overflow,
            jnp.int32(SKIP_DERIVATIVE_OVERFLOW),
            jnp.where(grads_finite, jnp.int32(APPLIED), jnp.int32(SKIP_NONFINITE_GRADS)),
        )
        metrics = {"loss": loss, "skipped": ~apply, "skip_reason": reason, "grad_norm": grad_norm}
        metrics.update({f"terms/{k}": v for k, v in terms.items()})
        metrics["scale_log2/loss"] = exact_log2(new_loss_scale.scale)
        metrics.update({f"scale_log2/{k}": exact_log2(s.scale) for k, s in deriv_scales.items()})
        metrics.update({f"found_inf/{k}": v for k, v in found_inf.items()})
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            loss_scale=new_loss_scale,
            deriv_scales=deriv_scales,
        )
        return new_state, metrics

    return step


def merge_found_inf(*flags: Mapping[str, jax.Array]) -> Dict[str, jax.Array]:
    """OR together the found_inf dicts of several engines (keys may overlap)."""
    out: Dict[str, jax.Array] = {}
    for f in flags:
        for k, v in f.items():
            out[k] = v if k not in out else out[k] | v
    return out
