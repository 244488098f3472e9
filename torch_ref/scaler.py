"""The dynamic scale rule (SPEC.md "The scale update") on torch tensors, CPU or CUDA.

Mirrors ``jaxamp/scaler.py``: one rule for the derivative scalers (scale the seeds
*down*, max 1) and the loss scaler (scale the loss *up*). The update is branch-free
(``torch.where``), so it never synchronises with the device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Union

import torch


SMALLEST_NORMAL = 2.0**-126  # float32; the hard floor of every scale, as in jaxamp


@dataclasses.dataclass
class ScaleState:
    """State of one scaler: ``scale`` (float32 0-d tensor), ``growth_tracker`` (int32 0-d tensor)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """``{"scale", "growth_tracker"}``: what ``torch.save`` stores (same leaves as jaxamp's ``ScaleState``)."""
        return {"scale": self.scale.detach().clone(), "growth_tracker": self.growth_tracker.detach().clone()}

    @classmethod
    def from_state_dict(cls, sd: Dict[str, object], device: Union[str, torch.device, None] = None) -> "ScaleState":
        """Build from ``{"scale", "growth_tracker"}`` holding tensors, numpy or jax scalars."""
        for key in ("scale", "growth_tracker"):
            if key not in sd:
                raise KeyError(f"ScaleState.from_state_dict: missing key {key!r}; got keys {sorted(sd)}.")
        return cls(
            scale=torch.as_tensor(_to_py(sd["scale"]), dtype=torch.float32, device=device),
            growth_tracker=torch.as_tensor(_to_py(sd["growth_tracker"]), dtype=torch.int32, device=device),
        )


def _to_py(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().reshape(()).item()
    try:  # numpy / jax scalar arrays
        import numpy as np

        return np.asarray(value).reshape(()).item()
    except Exception:  # pragma: no cover - plain python numbers
        return value


def _check_positive(name: str, value: float, *, integer: bool = False) -> None:
    kind = "a positive integer" if integer else "a positive finite number"
    if isinstance(value, bool) or (integer and not isinstance(value, int)):
        raise TypeError(f"DynamicScaler: `{name}`={value!r} must be {kind}.")
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"DynamicScaler: `{name}`={value!r} must be {kind}.")


@dataclasses.dataclass(frozen=True)
class DynamicScaler:
    """Growth/backoff rule with max scale and "recover" growth (same arguments and checks as jaxamp).

    ``update(state, found_inf)``: on ``found_inf`` the scale is multiplied by ``backoff_factor``
    (floored at ``min_scale`` if given, and always at float32's smallest normal 2**-126, as
    jaxamp) and the tracker resets; otherwise the tracker counts the
    clean step and, when it *equals* the interval (``recover_growth_interval`` while
    ``scale <= recover_threshold``, else ``growth_interval``), the scale grows by
    ``growth_factor`` up to ``max_scale`` and the tracker resets.
    """

    init_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    max_scale: float = 1.0
    recover_threshold: float = 2.0**-6
    recover_growth_interval: int = 100
    min_scale: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "max_scale", "recover_threshold"):
            _check_positive(name, getattr(self, name))
        _check_positive("growth_interval", self.growth_interval, integer=True)
        _check_positive("recover_growth_interval", self.recover_growth_interval, integer=True)
        if self.init_scale > self.max_scale:
            raise ValueError(
                f"DynamicScaler: `init_scale`={self.init_scale!r} must not exceed `max_scale`={self.max_scale!r}."
            )
        if self.recover_threshold > self.max_scale:
            raise ValueError(
                f"DynamicScaler: `recover_threshold`={self.recover_threshold!r} must not exceed "
                f"`max_scale`={self.max_scale!r}."
            )
        if self.recover_growth_interval > self.growth_interval:
            raise ValueError(
                f"DynamicScaler: `recover_growth_interval`={self.recover_growth_interval!r} must not exceed "
                f"`growth_interval`={self.growth_interval!r}."
            )
        if self.min_scale is not None:
            _check_positive("min_scale", self.min_scale)
            if self.min_scale > self.init_scale:
                raise ValueError(
                    f"DynamicScaler: `min_scale`={self.min_scale!r} must not exceed `init_scale`={self.init_scale!r}."
                )

    def init(self, device: Union[str, torch.device, None] = None) -> ScaleState:
        """``(init_scale, 0)`` on ``device``."""
        return ScaleState(
            scale=torch.tensor(self.init_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.tensor(0, dtype=torch.int32, device=device),
        )

    def update(self, state: ScaleState, found_inf: Union[bool, torch.Tensor]) -> ScaleState:
        """One step of the rule; returns a new state (the old one is not modified)."""
        scale = state.scale.to(torch.float32)
        tracker = state.growth_tracker.to(torch.int32)
        found = torch.as_tensor(found_inf, device=scale.device).to(torch.bool)
        f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=scale.device)  # noqa: E731
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=scale.device)  # noqa: E731

        floor = SMALLEST_NORMAL if self.min_scale is None else max(self.min_scale, SMALLEST_NORMAL)
        backed_off = torch.maximum(scale * f32(self.backoff_factor), f32(floor))
        n = tracker + 1
        interval = torch.where(
            scale <= f32(self.recover_threshold), i32(self.recover_growth_interval), i32(self.growth_interval)
        )
        grow = n == interval
        grown = torch.minimum(scale * f32(self.growth_factor), f32(self.max_scale))
        new_scale = torch.where(found, backed_off, torch.where(grow, grown, scale))
        new_tracker = torch.where(found | grow, i32(0), n)
        return ScaleState(scale=new_scale, growth_tracker=new_tracker)


def derivative_scaler(**overrides) -> DynamicScaler:
    """SPEC's derivative scaler defaults: init 1, max 1, interval 1000, recover below 2^-6 every 100."""
    params = dict(init_scale=1.0, max_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=1000, recover_threshold=2.0**-6, recover_growth_interval=100)
    params.update(overrides)
    return DynamicScaler(**params)


def loss_scaler(**overrides) -> DynamicScaler:
    """SPEC's loss scaler defaults: init 2^16, max 2^30, interval 1000, recover below 2^7 every 100."""
    params = dict(init_scale=2.0**16, max_scale=2.0**30, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=1000, recover_threshold=2.0**7, recover_growth_interval=100)
    params.update(overrides)
    return DynamicScaler(**params)
