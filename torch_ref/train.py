"""The skip-on-overflow training step in docs/algorithm.md's order ("Training step"), with
torch.optim and clip_grad_norm_.

Mirrors ``jaxamp.make_train_step``: (1) loss and derivatives with per-key overflow flags and
the bad-values flag (also set by a non-finite loss that no derivative flag explains);
(2) gradients of ``loss * loss_scale``; (3) bad values skip the update and change no scaler at
all; (4) any derivative overflow skips the update -- parameters, optimizer state and loss scaler
stay as they were; (5) otherwise the unscaled gradients, if finite, are clipped when asked
(``torch.nn.utils.clip_grad_norm_``) and applied and the loss scaler counts a clean step; if
not, the update is skipped and the loss scaler backs off; (6) except on bad values, every
derivative scaler updates with its own flag.

Schedules count *applied* updates, as optax does: ``optimizer.step()`` (and with it Adam's
step count) runs only on applied steps, and ``lr_schedule(n)`` is given the number of updates
applied before this one (optax's ``count``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from torch_ref.config import AmpSettings, as_settings
from torch_ref.derivatives import NONFINITE_VALUES, Derivatives
from torch_ref.scaler import ScaleState

APPLIED, SKIP_DERIVATIVE_OVERFLOW, SKIP_NONFINITE_GRADS, SKIP_NONFINITE_VALUES = 0, 1, 2, 3
# loss_fn(model, batch, scales) -> (loss f32 0-d, (terms {name: f32 0-d}, found_inf {key: bool 0-d}))
LossFn = Callable[..., Tuple[torch.Tensor, Tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]]


@dataclasses.dataclass
class TrainState:
    """What a torch_ref run carries between steps (the model and optimizer are updated in place)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    amp: AmpSettings
    loss_scale: ScaleState
    deriv_scales: Dict[str, ScaleState]
    step: int = 0  # steps taken, applied or skipped
    applied: int = 0  # optimizer updates applied (optax's count)

    @classmethod
    def create(cls, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, amp: Any,
               engines: Iterable[Derivatives] = (), keys: Sequence[str] = ()) -> "TrainState":
        """Loss scaler and one derivative scaler per key of ``engines`` and per key in ``keys``
        (the keys a :class:`torch_ref.Boundary` loss crosses: ``Scaling.ones().keys`` after one
        evaluation), none when the scalers are inactive (AMP off, bf16, fp32: loss scale 1)."""
        amp = as_settings(amp)
        device = next(model.parameters()).device
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise TypeError(f"TrainState.create: `keys`={keys!r} must be a list of scaler keys (strings), e.g. "
                            "('1', '2').")
        deriv: Dict[str, ScaleState] = {}
        for e in engines:
            if not isinstance(e, Derivatives):
                raise TypeError(f"TrainState.create: `engines` must hold torch_ref Derivatives, got {e!r}.")
            deriv.update(e.init_scaler_states(device))
        if amp.scaler_enabled:
            deriv.update({k: amp.derivative_scaler_for(k).init(device) for k in keys if k not in deriv})
        if amp.loss_scaling_enabled:
            loss_scale = amp.make_loss_scaler().init(device)
        else:
            loss_scale = ScaleState(torch.tensor(1.0, device=device), torch.tensor(0, dtype=torch.int32, device=device))
        return cls(model=model, optimizer=optimizer, amp=amp, loss_scale=loss_scale, deriv_scales=deriv)

    @property
    def scales(self) -> Dict[str, torch.Tensor]:
        return {k: s.scale for k, s in self.deriv_scales.items()}

    def scaler_state_dict(self) -> Dict[str, Any]:
        """The scalers and counters, for ``torch.save`` (same leaves as jaxamp's TrainState)."""
        return {
            "step": self.step,
            "applied": self.applied,
            "loss_scale": self.loss_scale.state_dict(),
            "deriv_scales": {k: s.state_dict() for k, s in self.deriv_scales.items()},
        }

    def load_scaler_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Load what :meth:`scaler_state_dict` wrote (or the same leaves taken from a jaxamp state)."""
        missing = [k for k in self.deriv_scales if k not in sd["deriv_scales"]]
        if missing:
            raise KeyError(f"load_scaler_state_dict: no saved state for scaler key(s) {missing}.")
        device = self.loss_scale.scale.device
        self.step, self.applied = int(sd["step"]), int(sd["applied"])
        self.loss_scale = ScaleState.from_state_dict(sd["loss_scale"], device)
        self.deriv_scales = {k: ScaleState.from_state_dict(sd["deriv_scales"][k], device) for k in self.deriv_scales}


def make_train_step(
    loss_fn: LossFn,
    *,
    grad_clip_max_norm: Optional[float] = None,
    lr_schedule: Optional[Callable[[int], float]] = None,
) -> Callable[[TrainState, Any], Dict[str, Any]]:
    """``step(state, batch) -> metrics``, updating ``state`` in place (see module docstring).

    ``grad_clip_max_norm``: None or 0 (default): no clipping, as jaxamp.

    Metrics (python numbers): loss, skipped, skip_reason, found_nonfinite_values, grad_norm,
    terms/*, scale_log2/*, found_inf/* -- the names jaxamp uses.
    """
    if grad_clip_max_norm is None:
        grad_clip_max_norm = 0.0
    if (isinstance(grad_clip_max_norm, bool) or not isinstance(grad_clip_max_norm, (int, float))
            or not math.isfinite(grad_clip_max_norm) or grad_clip_max_norm < 0):
        raise ValueError(f"make_train_step: `grad_clip_max_norm`={grad_clip_max_norm!r} must be a finite number >= 0.")

    def step(state: TrainState, batch: Any) -> Dict[str, Any]:
        params = [p for p in state.model.parameters() if p.requires_grad]
        loss_scale = state.loss_scale.scale
        loss, (terms, found_inf) = loss_fn(state.model, batch, state.scales)
        unknown = [k for k in found_inf if k not in state.deriv_scales and k != NONFINITE_VALUES]
        if unknown:
            raise KeyError(f"make_train_step: loss_fn reported found_inf for unknown scaler key(s) {unknown}; "
                           f"the state has {sorted(state.deriv_scales)}.")
        grads = torch.autograd.grad(loss.to(torch.float32) * loss_scale, params, allow_unused=True)
        flags = {k: bool(found_inf.get(k, False)) for k in state.deriv_scales}
        deriv_overflow = any(flags.values())
        # a non-finite loss no derivative scaler explains is bad values too: no loss scale cures a forward
        # value (AMP off, float32: the user's step as written, no bad-values rule)
        amp_on = state.amp.compute_dtype != torch.float32
        bad_values = bool(found_inf.get(NONFINITE_VALUES, False)) or (
            amp_on and not math.isfinite(float(loss.detach())) and not deriv_overflow)

        inv = 1.0 / loss_scale
        grads = [torch.zeros_like(p) if g is None else g * inv for p, g in zip(params, grads)]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        apply = finite and not deriv_overflow and not bad_values
        if apply:
            for p, g in zip(params, grads):
                p.grad = g.detach()
            if grad_clip_max_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip_max_norm)
            else:
                grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if lr_schedule is not None:
                for group in state.optimizer.param_groups:
                    group["lr"] = float(lr_schedule(state.applied))
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.applied += 1
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if state.amp.loss_scaling_enabled and not deriv_overflow and not bad_values:
            state.loss_scale = state.amp.make_loss_scaler().update(state.loss_scale, not finite)
        if not bad_values:
            state.deriv_scales = {
                k: state.amp.derivative_scaler_for(k).update(s, flags[k]) for k, s in state.deriv_scales.items()
            }
        state.step += 1
        reason = (SKIP_NONFINITE_VALUES if bad_values else SKIP_DERIVATIVE_OVERFLOW if deriv_overflow
                  else APPLIED if finite else SKIP_NONFINITE_GRADS)
        metrics: Dict[str, Any] = {"loss": float(loss.detach()), "skipped": not apply, "skip_reason": reason,
                                   "found_nonfinite_values": bad_values, "grad_norm": float(grad_norm)}
        metrics.update({f"terms/{k}": float(v.detach()) for k, v in terms.items()})
        metrics["scale_log2/loss"] = math.log2(float(state.loss_scale.scale))
        metrics.update({f"scale_log2/{k}": math.log2(float(s.scale)) for k, s in state.deriv_scales.items()})
        metrics.update({f"found_inf/{k}": v for k, v in flags.items()})
        return metrics

    return step
