"""`AmpConfig`: the Modulus ``amp:`` keys plus the scaler hyper-parameters, validated up front."""

from __future__ import annotations

import dataclasses
import os
from types import MappingProxyType
from typing import Any, Mapping, Optional, Tuple, Union

import jax.numpy as jnp

from jaxamp.scaler import DynamicScaler, derivative_scaler, loss_scaler

MODES = ("per_order_scaler", "per_term_scaler")
DTYPES = ("float16", "bfloat16", "float32")
# Scaler hyper-parameters a config may override. The derivative scalers' max scale comes
# from `default_max_scale_log2` / `custom_max_scales_log2`, so it is not listed for them.
DERIVATIVE_SCALER_KEYS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "recover_threshold",
    "recover_growth_interval",
    "min_scale",
)
LOSS_SCALER_KEYS = DERIVATIVE_SCALER_KEYS + ("max_scale",)
# float32's exponent range: a max scale of 2**k must be a normal, finite float32.
_LOG2_RANGE = (-126, 127)


class ConfigError(ValueError):
    """A bad configuration value. The message names the key, the value and what is allowed."""


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"amp.{key}={value!r} is not allowed: expected {allowed}.")


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(key, value, "true or false")


def _check_log2(key: str, value: Any) -> None:
    lo, hi = _LOG2_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _fail(key, value, f"an integer exponent in [{lo}, {hi}] (max scale = 2**value)")


def _check_scaler_overrides(key: str, value: Any, allowed_keys: Tuple[str, ...]) -> None:
    if not isinstance(value, Mapping):
        _fail(key, value, f"a mapping with keys among {list(allowed_keys)}")
    for name in value:
        if name not in allowed_keys:
            _fail(f"{key}.{name}", value[name], f"one of the keys {list(allowed_keys)} (unknown key)")


def _scaler_key(key: Any) -> str:
    """Scaler keys are strings: per-order keys are the order ("1", "2"), others term names."""
    if isinstance(key, bool) or not isinstance(key, (int, str)) or str(key) == "":
        _fail("custom_max_scales_log2", key, "keys that are an order (int >= 1) or a term name (str)")
    if isinstance(key, int) and key < 1:
        _fail("custom_max_scales_log2", key, "an order >= 1")
    return str(key)


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """Mixed-precision settings, with Modulus Sym's ``amp:`` keys and defaults.

    Attributes:
      enabled: mixed precision on. When False everything runs in float32, unscaled.
      mode: ``"per_order_scaler"`` (one derivative scaler per derivative order) or
        ``"per_term_scaler"`` (one per differentiated variable).
      dtype: compute dtype, ``"float16"``, ``"bfloat16"`` or ``"float32"``. The derivative
        and loss scalers are active only for float16 (bf16 has float32's range).
      autocast_activation: evaluate activations in the compute dtype. False (default):
        activations are evaluated in float32 (upcast, activate, downcast).
      autocast_firstlayer: run the first layer in the compute dtype. False (default): the
        first layer and its activation run in float32.
      default_max_scale_log2: every derivative scaler's max scale is ``2**this``.
      custom_max_scales_log2: per-key overrides of that exponent, e.g. ``{2: -4, "nu": 20}``.
      special_terms: variables that get their own derivative scaler, keyed by their name,
        even in per-order mode (e.g. a turbulence model's ``nu``).
      derivative_scaler: overrides of the derivative scalers' hyper-parameters.
      loss_scaler: overrides of the weight-gradient loss scaler's hyper-parameters.
      derivative_scaling: scale the input derivatives (the DerivScaler). False with
        float16: plain fp16, the loss scaler only.
    """

    enabled: bool = True
    mode: str = "per_order_scaler"
    dtype: str = "float16"
    autocast_activation: bool = False
    autocast_firstlayer: bool = False
    default_max_scale_log2: int = 0
    custom_max_scales_log2: Mapping[str, int] = dataclasses.field(default_factory=dict)
    special_terms: Tuple[str, ...] = ()
    derivative_scaler: Mapping[str, float] = dataclasses.field(default_factory=dict)
    loss_scaler: Mapping[str, float] = dataclasses.field(default_factory=dict)
    derivative_scaling: bool = True

    def __post_init__(self) -> None:
        _check_bool("enabled", self.enabled)
        _check_bool("derivative_scaling", self.derivative_scaling)
        if self.mode not in MODES:
            _fail("mode", self.mode, f"one of {list(MODES)}")
        if self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"one of {list(DTYPES)}")
        _check_bool("autocast_activation", self.autocast_activation)
        _check_bool("autocast_firstlayer", self.autocast_firstlayer)
        _check_log2("default_max_scale_log2", self.default_max_scale_log2)
        if not isinstance(self.custom_max_scales_log2, Mapping):
            _fail("custom_max_scales_log2", self.custom_max_scales_log2, "a mapping {key: int}")
        custom = {}
        for key, value in self.custom_max_scales_log2.items():
            _check_log2(f"custom_max_scales_log2[{key!r}]", value)
            custom[_scaler_key(key)] = value
        object.__setattr__(self, "custom_max_scales_log2", MappingProxyType(custom))
        terms = self.special_terms
        if isinstance(terms, str) or not all(isinstance(t, str) and t for t in terms):
            _fail("special_terms", terms, "a list of non-empty variable names (str)")
        object.__setattr__(self, "special_terms", tuple(terms))
        _check_scaler_overrides("derivative_scaler", self.derivative_scaler, DERIVATIVE_SCALER_KEYS)
        _check_scaler_overrides("loss_scaler", self.loss_scaler, LOSS_SCALER_KEYS)
        object.__setattr__(self, "derivative_scaler", MappingProxyType(dict(self.derivative_scaler)))
        object.__setattr__(self, "loss_scaler", MappingProxyType(dict(self.loss_scaler)))
        # Build every scaler once so that a bad hyper-parameter fails here, not mid-run.
        for key in ("__default__", *custom):
            try:
                self.derivative_scaler_for(key)
            except (TypeError, ValueError) as e:
                where = "default_max_scale_log2" if key == "__default__" else f"custom_max_scales_log2[{key!r}]"
                raise ConfigError(f"amp.derivative_scaler with amp.{where}: {e}") from None
        try:
            self.make_loss_scaler()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"amp.loss_scaler: {e}") from None

    # ---------------------------------------------------------------- derived settings
    @property
    def scaler_enabled(self) -> bool:
        """True when the derivative scalers act: AMP on, dtype float16 and derivative_scaling."""
        return self.loss_scaling_enabled and self.derivative_scaling

    @property
    def loss_scaling_enabled(self) -> bool:
        """True when the weight-gradient loss scaler acts: AMP on and dtype float16."""
        return self.enabled and self.dtype == "float16"

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The dtype matmuls run in (float32 when AMP is off)."""
        return jnp.dtype(self.dtype if self.enabled else "float32")

    def max_scale_log2(self, key: str) -> int:
        return self.custom_max_scales_log2.get(str(key), self.default_max_scale_log2)

    def derivative_scaler_for(self, key: str) -> DynamicScaler:
        """The derivative scaler rule for one scaler key (its own max scale)."""
        return derivative_scaler(max_scale=2.0 ** self.max_scale_log2(key), **self.derivative_scaler)

    def make_loss_scaler(self) -> DynamicScaler:
        return loss_scaler(**self.loss_scaler)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, values: Optional[Mapping[str, Any]]) -> "AmpConfig":
        """Build from a mapping of ``amp:`` keys (or a mapping with an ``amp`` entry).

        Unknown keys are rejected with the list of allowed ones.
        """
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise ConfigError(f"amp config must be a mapping of keys to values, got {values!r}.")
        if set(values) == {"amp"}:
            values = values["amp"] or {}
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in allowed]
        if unknown:
            raise ConfigError(f"amp config has unknown key(s) {unknown}: allowed keys are {allowed}.")
        values = dict(values)
        if "special_terms" in values and isinstance(values["special_terms"], list):
            values["special_terms"] = tuple(values["special_terms"])
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: Union[str, os.PathLike]) -> "AmpConfig":
        """Build from a YAML file holding an ``amp:`` section (or the bare keys)."""
        import yaml

        with open(path) as f:
            values = yaml.safe_load(f)
        return cls.from_dict(values)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("custom_max_scales_log2", "derivative_scaler", "loss_scaler"):
            out[key] = dict(getattr(self, key))
        out["special_terms"] = list(self.special_terms)
        return out
