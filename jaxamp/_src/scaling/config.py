"""`AmpConfig`: Modulus' ``amp:`` keys and the scalers' hyper-parameters, validated up front."""

from __future__ import annotations

import dataclasses
import functools
import os
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Tuple, Union

import jax.numpy as jnp

from jaxamp._src.scaling.config_values import (FP8_FORMATS, LOG2_RANGE, ROLES, ConfigError, check_flags, check_log2,
                                               dtype_name, fail, float8_formats, per_key, plain, scaler_overrides)
from jaxamp._src.scaling.scaler import DynamicScaler, ScalerArgumentError, loss_scaler

__all__ = ["MODES", "DTYPES", "DERIVATIVE_SCALER_KEYS", "LOSS_SCALER_KEYS", "ConfigError", "check_flags", "AmpConfig"]

MODES = ("per_order_scaler", "per_term_scaler")
DTYPES = ("float16", "bfloat16", "float32", "float8")
# Scaler hyper-parameters a config may override (derivative max scales come from the *_log2 keys).
DERIVATIVE_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "recover_threshold",
                          "recover_growth_interval", "min_scale")
LOSS_SCALER_KEYS = DERIVATIVE_SCALER_KEYS + ("max_scale",)
_DERIVATIVE_DEFAULTS = MappingProxyType({f.name: f.default for f in dataclasses.fields(DynamicScaler)})
def _build(section: str, make: Callable[[], DynamicScaler], note: str) -> None:
    """Build a scaler rule; its error names the config's keys (``amp.{section}.{field}``) and ``note``."""
    try:
        make()
    except ScalerArgumentError as e:
        msg = e.describe(lambda field: f"amp.{section}.{field}")
        involved = "max_scale" in msg or ("init_scale" in msg and "init_scale =" in note)
        raise ConfigError(msg + (note if involved else "") + ".") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AmpConfig:
    """Mixed-precision settings, with Modulus Sym's ``amp:`` keys and defaults.

    Attributes:
      enabled: mixed precision on; False: everything runs in float32, unscaled.
      mode: ``"per_order_scaler"`` (one derivative scaler per order) or ``"per_term_scaler"``
        (one per differentiated variable).
      dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``; the scalers act only for float16.
      autocast_activation: evaluate activations in the compute dtype (default: in float32).
      autocast_firstlayer: run the first layer in the compute dtype (default: in float32).
      default_max_scale_log2: every derivative scaler's max scale is ``2**this``.
      custom_max_scales_log2: per-key overrides of that exponent, e.g. ``{2: -4, "nu": 20}``.
      custom_init_scales_log2: per-key start scales, e.g. ``{2: -4}``: key ``"2"`` starts at 2^-4
        (as :meth:`jaxamp._src.core.window.Recommendation.apply` sets) and grows up to its max scale.
      special_terms: variables with their own derivative scaler even in per-order mode.
      derivative_scaler: overrides of the derivative scalers' hyper-parameters.
      loss_scaler: overrides of the weight-gradient loss scaler's hyper-parameters.
      derivative_scaling: scale the input derivatives; False with float16: the loss scaler only.
      dtype ``"float8"``: autocast's matmuls take FP8 operands (:data:`jaxamp._src.placement.tensor_scale.FP8_FORMATS`
        per role), everything else runs as for ``"float16"`` (scalers included).
      tensor_scaling: per-tensor power-of-two scales for autocast's float16 / FP8 matmul operands
        (``jaxamp/_src/placement/tensor_scale.py``); None (default): on for ``"float8"``, off otherwise.
      float8_formats: with dtype ``"float8"``, overrides of the recipe's operand format per role,
        e.g. ``{"tangent": "float8_e5m2"}``: roles ``"value"``, ``"tangent"``, ``"cotangent"``,
        formats ``"float16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` (the rest keep the recipe's).
      recompute_float32: the weight gradient's backward pass keeps only the 16-bit matmul outputs
        (and the parameters' 16-bit casts) and recomputes the float32 values computed from them
        (the first layer's outputs, float32 activations and their derivative streams) instead of
        storing them: the same numbers, about half the device memory of the GPU step, a few more
        kernels (``jaxamp/_src/placement/recompute.py``, docs/gpu.md). False: stored, as
        ``jax.grad`` does. For plain casts (not with per-tensor scaling or FP8).

    A bad value raises :class:`ConfigError` naming the key, the value and what is allowed.
    The mapping fields are read-only (sorted, dict-like); equal configs hash equal, however built
    (a jit static argument, a cache key), and a config pickles and deep-copies.

    Example:
      >>> from jaxamp import AmpConfig
      >>> amp = AmpConfig(dtype="float16", custom_max_scales_log2={2: 3}, custom_init_scales_log2={2: -4})
      >>> amp.derivative_scaler_for("2").max_scale, amp.derivative_scaler_for("2").init_scale
      (8.0, 0.0625)
    """

    enabled: bool = True
    mode: str = "per_order_scaler"
    dtype: str = "float16"
    autocast_activation: bool = False
    autocast_firstlayer: bool = False
    default_max_scale_log2: int = 0
    custom_max_scales_log2: Mapping[str, int] = dataclasses.field(default_factory=dict)
    custom_init_scales_log2: Mapping[str, int] = dataclasses.field(default_factory=dict)
    special_terms: Tuple[str, ...] = ()
    derivative_scaler: Mapping[str, float] = dataclasses.field(default_factory=dict)
    loss_scaler: Mapping[str, float] = dataclasses.field(default_factory=dict)
    derivative_scaling: bool = True
    tensor_scaling: Optional[bool] = None
    float8_formats: Mapping[str, str] = dataclasses.field(default_factory=dict)
    recompute_float32: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))  # jnp.float16 -> "float16"
        if self.tensor_scaling is not None and not isinstance(self.tensor_scaling, bool):
            fail("tensor_scaling", self.tensor_scaling, "true, false or null (on for float8)")
        if self.tensor_scaling is None:  # on for float8, off otherwise
            object.__setattr__(self, "tensor_scaling", self.dtype == "float8")
        if self.tensor_scaling and self.dtype == "bfloat16":  # it scales float16 / FP8 operands only
            fail("tensor_scaling", True, 'false or null with dtype "bfloat16" (per-tensor scales are for float16 and '
                 'float8 matmul operands; bfloat16 has float32\'s exponent range)')
        float8_formats(self)
        choices = {"mode": MODES, "dtype": DTYPES}  # the others are flags
        for key in [f.name for f in dataclasses.fields(self) if f.type in ("bool", "str")]:  # flags and choices
            value = getattr(self, key)
            if key in choices and value not in choices[key]:
                fail(key, value, f"one of {list(choices[key])}")
            if key not in choices and not isinstance(value, bool):
                fail(key, value, "true or false")
        check_log2("default_max_scale_log2", self.default_max_scale_log2)
        custom = per_key(self, "custom_max_scales_log2", "max scale")
        inits = per_key(self, "custom_init_scales_log2", "init scale")
        where = {k: f"custom_max_scales_log2[{k!r}]" if k in custom else "default_max_scale_log2"
                 for k in ("__default__", *custom, *inits)}  # where each key's max scale comes from
        for key, value in inits.items():  # a start above the key's max scale: name both
            if value > (top := self.max_scale_log2(key)):
                fail(f"custom_init_scales_log2[{key!r}]", value, f"an integer exponent in [{LOG2_RANGE[0]}, {top}]"
                      f" (a key starts at or below its max scale 2**amp.{where[key]} = 2**{top})")
        terms = plain(self.special_terms)  # a ListConfig as a list
        if isinstance(terms, str) or not all(isinstance(t, str) and t for t in terms):
            fail("special_terms", terms, "a list of non-empty variable names (str)")
        object.__setattr__(self, "special_terms", tuple(terms))
        scaler_overrides(self, "derivative_scaler", DERIVATIVE_SCALER_KEYS)
        scaler_overrides(self, "loss_scaler", LOSS_SCALER_KEYS)
        # Build every scaler once so that a bad hyper-parameter fails here, not mid-run.
        for key in where:
            start = f", init_scale = 2**amp.custom_init_scales_log2[{key!r}]" if key in inits else ""
            note = f" (max_scale = 2**amp.{where[key]}{start})"
            _build("derivative_scaler", lambda: self.derivative_scaler_for(key), note)
        _build("loss_scaler", lambda: loss_scaler(**self.loss_scaler), "")

    @property
    def scaler_enabled(self) -> bool:
        """True when the derivative scalers act: AMP on, dtype float16 and derivative_scaling."""
        return self.loss_scaling_enabled and self.derivative_scaling

    @property
    def loss_scaling_enabled(self) -> bool:
        """True when the weight-gradient loss scaler acts: AMP on and dtype float16 (or float8)."""
        return self.enabled and self.dtype in ("float16", "float8")

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The dtype low-precision work runs in (float32 when AMP is off; float16 for float8,
        whose matmul operands take :attr:`matmul_formats`)."""
        return jnp.dtype(("float16" if self.dtype == "float8" else self.dtype) if self.enabled else "float32")

    @property
    def off(self) -> bool:
        """AMP off (``enabled=False`` or ``dtype="float32"``): nothing is cast, no scaler acts, every
        jaxamp call is the user's program as written. The one home of that test."""
        return self.compute_dtype == jnp.float32

    @property
    def matmul_formats(self) -> Optional[Tuple[str, str, str]]:
        """The formats of autocast's matmul operands (value, tangent, cotangent) when they differ
        from plain casts to :attr:`compute_dtype` (per-tensor scaling or FP8), else None."""
        scaled_operands = self.tensor_scaling or self.dtype == "float8"
        if not self.enabled or self.dtype not in ("float16", "float8") or not scaled_operands:
            return None
        if self.dtype != "float8":
            return ("float16",) * 3
        return tuple(self.float8_formats.get(role, fmt) for role, fmt in zip(ROLES, FP8_FORMATS))

    @property
    def recomputes(self) -> bool:
        """True when the weight gradient recomputes its float32 values (:attr:`recompute_float32`):
        AMP on with plain casts to :attr:`compute_dtype` (no :attr:`matmul_formats`)."""
        return self.recompute_float32 and not self.off and self.matmul_formats is None

    def max_scale_log2(self, key: str) -> int:
        """The exponent of ``key``'s max scale: its custom value, else ``default_max_scale_log2``."""
        return self.custom_max_scales_log2.get(str(key), self.default_max_scale_log2)

    def derivative_scaler_for(self, key: str) -> DynamicScaler:
        """The derivative scaler rule of one scaler key: the one place a key's rule is built.

        Args:
          key: a scaler key (an order ``"1"``, ``"2"``, or a term name).

        Returns:
          :class:`~jaxamp._src.scaling.scaler.DynamicScaler` with the ``derivative_scaler`` overrides, max scale
          ``2**max_scale_log2(key)`` and the key's ``custom_init_scales_log2`` start; a max scale
          below the default ``init_scale`` or ``recover_threshold`` caps them.

        Example:
          >>> from jaxamp import AmpConfig
          >>> rule = AmpConfig(custom_max_scales_log2={2: -9}).derivative_scaler_for("2")
          >>> rule.init_scale == rule.recover_threshold == rule.max_scale == 2.0**-9
          True
          >>> rule = AmpConfig(custom_init_scales_log2={2: -9}).derivative_scaler_for("2")
          >>> rule.init_scale == 2.0**-9 and rule.max_scale == 1.0
          True
        """
        max_scale = 2.0 ** self.max_scale_log2(key)
        capped = {name: min(_DERIVATIVE_DEFAULTS[name], max_scale) for name in ("init_scale", "recover_threshold")}
        starts = self.custom_init_scales_log2
        own = {"init_scale": 2.0 ** starts[str(key)]} if str(key) in starts else {}
        return DynamicScaler(max_scale=max_scale, **{**capped, **self.derivative_scaler, **own})

    def make_loss_scaler(self) -> Optional[DynamicScaler]:
        """The weight-gradient loss scaler rule (``loss_scaler``'s overrides), or None when off."""
        return loss_scaler(**self.loss_scaler) if self.loss_scaling_enabled else None

    @classmethod
    def from_dict(cls, values: Any) -> "AmpConfig":
        """Build from a mapping of ``amp:`` keys (or a mapping with an ``amp`` entry).

        Args:
          values: a ``dict``, any mapping-like config (``ConfigDict``, ``DictConfig``) or None.

        Returns:
          The validated config; unknown keys and bad values raise :class:`ConfigError`.

        Example:
          >>> from jaxamp import AmpConfig
          >>> AmpConfig.from_dict({"amp": {"dtype": "bfloat16"}}).dtype
          'bfloat16'
        """
        values = {} if values is None else plain(values)
        entry = isinstance(values, dict) and set(values) == {"amp"}  # {"amp": {keys}}
        values = (values["amp"] or {}) if entry else values
        if not isinstance(values, dict):
            raise ConfigError(f"amp config{': the `amp` entry' if entry else ''} must be a mapping of keys to values, "
                              f"got {values!r}.")
        return cls(**values)  # an unknown key raises a ConfigError naming it and the allowed keys

    @classmethod
    def from_yaml(cls, path: Union[str, os.PathLike]) -> "AmpConfig":
        """The validated config of the YAML file ``path`` holding an ``amp:`` section (or the bare
        keys); malformed YAML raises :class:`ConfigError` naming the file and line."""
        import yaml

        with open(path) as f:
            try:
                values = yaml.safe_load(f)
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f"{os.fspath(path)}, line {mark.line + 1}" if mark is not None else os.fspath(path)
                problem = getattr(e, "problem", None) or str(e)
                raise ConfigError(f"{where}: not valid YAML ({problem}); fix the syntax there.") from None
        try:
            return cls.from_dict(values)
        except ConfigError as e:
            raise ConfigError(f"{os.fspath(path)}: {e}") from None

    def to_dict(self) -> dict:
        """Plain ``{key: value}`` that :meth:`from_dict` takes back."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # mappings, lists


_DATACLASS_INIT = AmpConfig.__init__  # wrapped below: a positional or unknown argument is a ConfigError


@functools.wraps(_DATACLASS_INIT)
def _init(self: AmpConfig, *args: Any, **kwargs: Any) -> None:
    unknown = [k for k in kwargs if k not in AmpConfig.__dataclass_fields__]
    if args or unknown:
        what = f"the positional value(s) {list(args)!r}" if args else f"unknown key(s) {unknown}"
        raise ConfigError(f"amp config has {what}: allowed keys are {list(AmpConfig.__dataclass_fields__)}, by name, "
                          "e.g. AmpConfig(**config.amp); remove or rename them (a whole config: pass its amp section).")
    _DATACLASS_INIT(self, **kwargs)


AmpConfig.__init__ = _init  # type: ignore[method-assign]
