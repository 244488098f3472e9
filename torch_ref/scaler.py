"""The dynamic scale rule (docs/algorithm.md, "Scale update") on torch tensors, CPU or CUDA.

Mirrors ``jaxamp/scaler.py``: one rule for the derivative scalers (scale the seeds
*down*, max 1) and the loss scaler (scale the loss *up*). The update is branch-free
(``torch.where``), so it never synchronises with the device.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from types import MappingProxyType
from typing import Callable, Dict, Optional, Union

import torch


SMALLEST_NORMAL = 2.0**-126  # float32; the hard floor of every scale, as in jaxamp
# The loss scaler's defaults where they differ from DynamicScaler's (docs/algorithm.md, "Defaults").
LOSS_SCALER_DEFAULTS = MappingProxyType({"init_scale": 2.0**16, "max_scale": 2.0**30, "recover_threshold": 2.0**7})


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


def _check(name: str, value: object, allowed: str, ok: Callable[[float], bool], *, integer: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"DynamicScaler: `{name}`={value!r} is not allowed: expected {allowed}.")
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"DynamicScaler: `{name}`={value!r} is not allowed: expected {allowed}.")


def _order(small: str, a: float, large: str, b: float) -> None:
    if a > b:
        raise ValueError(f"DynamicScaler: `{small}`={a!r} must not exceed `{large}`={b!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicScaler:
    """Growth/backoff rule with max scale and "recover" growth (same arguments and checks as jaxamp).

    The field defaults are the derivative scalers' (docs/algorithm.md, "Defaults"); the loss
    scaler's are :func:`loss_scaler`'s. ``update(state, found_inf)``: on ``found_inf`` the
    scale is multiplied by ``backoff_factor`` (floored at ``min_scale`` if given, and always at
    float32's smallest normal 2**-126, as jaxamp) and the tracker resets; otherwise the tracker
    counts the clean step and, when it *equals* the interval (``recover_growth_interval`` while
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
        positive = "a finite number > 0"
        _check("init_scale", self.init_scale, positive, lambda v: v > 0)
        _check("growth_factor", self.growth_factor, "a finite number > 1 (the scale grows by it)", lambda v: v > 1)
        _check("backoff_factor", self.backoff_factor, "a number in (0, 1) (the scale shrinks by it)",
               lambda v: 0 < v < 1)
        _check("max_scale", self.max_scale, positive, lambda v: v > 0)
        _check("recover_threshold", self.recover_threshold, positive, lambda v: v > 0)
        for name in ("growth_interval", "recover_growth_interval"):
            _check(name, getattr(self, name), "a positive integer", lambda v: v > 0, integer=True)
        if self.min_scale is not None:
            _check("min_scale", self.min_scale, positive, lambda v: v > 0)
            _order("min_scale", self.min_scale, "max_scale", self.max_scale)
            _order("min_scale", self.min_scale, "init_scale", self.init_scale)
        _order("init_scale", self.init_scale, "max_scale", self.max_scale)
        _order("recover_threshold", self.recover_threshold, "max_scale", self.max_scale)
        _order("recover_growth_interval", self.recover_growth_interval, "growth_interval", self.growth_interval)

    @property
    def floor(self) -> float:
        """The lowest scale a backoff reaches: ``max(min_scale, 2**-126)``."""
        return SMALLEST_NORMAL if self.min_scale is None else max(self.min_scale, SMALLEST_NORMAL)

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

        backed_off = torch.maximum(scale * f32(self.backoff_factor), f32(self.floor))
        n = tracker + 1
        interval = torch.where(
            scale <= f32(self.recover_threshold), i32(self.recover_growth_interval), i32(self.growth_interval)
        )
        grow = n == interval
        grown = torch.minimum(scale * f32(self.growth_factor), f32(self.max_scale))
        new_scale = torch.where(found, backed_off, torch.where(grow, grown, scale))
        new_tracker = torch.where(found | grow, i32(0), n)
        return ScaleState(scale=new_scale, growth_tracker=new_tracker)


def loss_scaler(**overrides: object) -> DynamicScaler:
    """The loss scaler: :data:`LOSS_SCALER_DEFAULTS` over :class:`DynamicScaler`'s defaults, then ``overrides``."""
    return DynamicScaler(**{**LOSS_SCALER_DEFAULTS, **overrides})
