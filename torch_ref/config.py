"""`AmpSettings`: the Modulus ``amp:`` keys (the same keys as ``jaxamp.AmpConfig``), for torch.

``torch_ref`` stands alone (it never imports jaxamp), so it has its own small settings
class. :func:`as_settings` accepts an ``AmpSettings``, a plain mapping of the keys, or any
object with a ``to_dict()`` of them (e.g. a ``jaxamp.AmpConfig``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Tuple

import torch

from torch_ref.scaler import DynamicScaler, loss_scaler

MODES = ("per_order_scaler", "per_term_scaler")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class AmpSettings:
    """Mixed-precision settings; see ``jaxamp.AmpConfig`` for the meaning of each key."""

    enabled: bool = True
    mode: str = "per_order_scaler"
    dtype: str = "float16"
    autocast_activation: bool = False
    autocast_firstlayer: bool = False
    default_max_scale_log2: int = 0
    custom_max_scales_log2: Mapping[str, int] = dataclasses.field(default_factory=dict)
    custom_init_scales_log2: Mapping[str, int] = dataclasses.field(default_factory=dict)  # per-key start
    special_terms: Tuple[str, ...] = ()
    derivative_scaler: Mapping[str, float] = dataclasses.field(default_factory=dict)
    loss_scaler: Mapping[str, float] = dataclasses.field(default_factory=dict)
    derivative_scaling: bool = True
    tensor_scaling: bool = False  # the rule is torch_ref.tensor_scale; the reference trains without it
    float8_formats: Mapping[str, str] = dataclasses.field(default_factory=dict)  # likewise: no FP8 training
    recompute_float32: bool = True  # what jaxamp's backward pass stores (the same numbers): no effect here

    def __post_init__(self) -> None:
        if self.tensor_scaling is not False:
            raise ValueError(f"amp.tensor_scaling={self.tensor_scaling!r} is not supported by torch_ref's training "
                             "(its per-tensor rule is torch_ref.tensor_scale): expected false.")
        if dict(self.float8_formats):
            raise ValueError(f"amp.float8_formats={dict(self.float8_formats)!r} is not supported by torch_ref's "
                             "training (it trains without FP8): expected {}.")
        for key in ("enabled", "autocast_activation", "autocast_firstlayer", "derivative_scaling", "recompute_float32"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"amp.{key}={getattr(self, key)!r} is not allowed: expected true or false.")
        if self.mode not in MODES:
            raise ValueError(f"amp.mode={self.mode!r} is not allowed: expected one of {list(MODES)}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"amp.dtype={self.dtype!r} is not allowed: expected one of {list(DTYPES)}.")
        logs = {"default_max_scale_log2": self.default_max_scale_log2}
        for field in ("custom_max_scales_log2", "custom_init_scales_log2"):
            logs.update({f"{field}[{k!r}]": v for k, v in dict(getattr(self, field)).items()})
        for key, value in logs.items():
            if isinstance(value, bool) or not isinstance(value, int) or not -126 <= value <= 127:
                raise ValueError(f"amp.{key}={value!r} is not allowed: expected an integer exponent in [-126, 127].")
        for field in ("custom_max_scales_log2", "custom_init_scales_log2"):
            object.__setattr__(self, field, {str(k): v for k, v in getattr(self, field).items()})
        terms = self.special_terms
        if isinstance(terms, str) or not all(isinstance(t, str) and t for t in terms):
            raise ValueError(f"amp.special_terms={terms!r} is not allowed: expected a list of variable names.")
        object.__setattr__(self, "special_terms", tuple(terms))
        object.__setattr__(self, "derivative_scaler", dict(self.derivative_scaler))
        object.__setattr__(self, "loss_scaler", dict(self.loss_scaler))
        for key in ("__default__", *self.custom_max_scales_log2, *self.custom_init_scales_log2):  # fail now
            self.derivative_scaler_for(key)
        self.make_loss_scaler()

    @property
    def scaler_enabled(self) -> bool:
        """True when the derivative scalers act: AMP on, dtype float16 and derivative_scaling."""
        return self.loss_scaling_enabled and self.derivative_scaling

    @property
    def loss_scaling_enabled(self) -> bool:
        """True when the weight-gradient loss scaler acts: AMP on and dtype float16."""
        return self.enabled and self.dtype == "float16"

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype] if self.enabled else torch.float32

    def max_scale_log2(self, key: str) -> int:
        return self.custom_max_scales_log2.get(str(key), self.default_max_scale_log2)

    def derivative_scaler_for(self, key: str) -> DynamicScaler:
        start = self.custom_init_scales_log2.get(str(key))
        own = {} if start is None else {"init_scale": 2.0**start}  # the key's start wins, as in jaxamp
        return DynamicScaler(max_scale=2.0 ** self.max_scale_log2(key), **{**self.derivative_scaler, **own})

    def make_loss_scaler(self) -> DynamicScaler:
        return loss_scaler(**self.loss_scaler)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "AmpSettings":
        """From ``{key: value}`` (or ``{"amp": {...}}``); unknown keys are rejected by name."""
        if not isinstance(values, Mapping):
            raise TypeError(f"AmpSettings.from_dict: expected a mapping of amp keys, got {values!r}.")
        if set(values) == {"amp"}:
            values = values["amp"] or {}
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in allowed]
        if unknown:
            raise ValueError(f"amp config has unknown key(s) {unknown}: allowed keys are {allowed}.")
        return cls(**dict(values))


def as_settings(amp: Any) -> AmpSettings:
    """``AmpSettings`` from an ``AmpSettings``, a mapping, an object with ``to_dict()``, or None (AMP off)."""
    if amp is None:
        return AmpSettings(enabled=False)
    if isinstance(amp, AmpSettings):
        return amp
    if isinstance(amp, Mapping):
        return AmpSettings.from_dict(amp)
    if hasattr(amp, "to_dict"):
        return AmpSettings.from_dict(amp.to_dict())
    raise TypeError(f"`amp`={amp!r} must be an AmpSettings, a mapping of amp keys, or have to_dict().")
