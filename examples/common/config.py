"""Example configs: YAML files with Modulus ``amp:`` keys, variants, modes, CLI overrides, checks.

A config file may name another one with ``base: <name>`` (a file in ``examples/configs``);
it is loaded first and the variant's keys are merged over it, so variants never copy a
default. The *root* of that chain (the problem's default file) is the schema: any key it
does not have is unknown, and every value must have the type of the default's value. The
``amp:`` section is checked by :class:`jaxamp.AmpConfig` instead.

``mode`` picks a preset of ``amp:`` keys (:data:`MODES`); ``custom`` uses ``amp:`` as written.
Order of precedence: file(s) < mode preset < command-line ``key=value`` overrides.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

import jaxamp

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

_REDUCED = {"enabled": True, "autocast_firstlayer": True, "autocast_activation": True}
# Every reduced-precision mode runs *all* layers (first included) in the reduced dtype, so
# fp16_plain and the fp16_scaler_* modes differ only in derivative scaling.
MODES: Dict[str, Dict[str, Any]] = {
    "fp32": {"enabled": False, "dtype": "float32", "derivative_scaling": False},
    "fp16_plain": {**_REDUCED, "dtype": "float16", "derivative_scaling": False},
    "fp16_scaler_per_order": {**_REDUCED, "dtype": "float16", "mode": "per_order_scaler", "derivative_scaling": True},
    "fp16_scaler_per_term": {**_REDUCED, "dtype": "float16", "mode": "per_term_scaler", "derivative_scaling": True},
    "bf16": {**_REDUCED, "dtype": "bfloat16", "derivative_scaling": False},
}
MODE_NAMES = tuple(MODES) + ("custom",)

Check = Tuple[Callable[[Any], bool], str]

# The examples' own keys of the ``amp:`` section (not AmpConfig's; every config has them, with
# these defaults). init_scales_from_profile: before training, profile the initial parameters on
# the first batch and start every derivative scaler at the recommended scale
# (jaxamp.profile(...)(...).recommend().apply(amp); examples/common/train.py).
EXAMPLE_AMP_DEFAULTS: Dict[str, Any] = {"init_scales_from_profile": False}


def positive_int() -> Check:
    return (lambda v: v >= 1, "an integer >= 1")


def positive() -> Check:
    return (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def nonnegative() -> Check:
    return (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def one_of(*options: Any) -> Check:
    return (lambda v: v in options, f"one of {list(options)}")


def in_open_unit() -> Check:
    return (lambda v: math.isfinite(v) and 0 < v <= 1, "a number in (0, 1]")


# Checks every problem shares; problems add their own (see Problem.checks).
COMMON_CHECKS: Dict[str, Check] = {
    "seed": (lambda v: v >= 0, "an integer >= 0"),
    "mode": one_of(*MODE_NAMES),
    "model.arch": one_of("fully_connected", "fourier"),
    "model.layer_size": positive_int(),
    "model.nr_layers": positive_int(),
    "model.activation": one_of(*jaxamp.models.FullyConnected.activations),
    "optimizer.lr": positive(),
    "optimizer.decay_rate": in_open_unit(),
    "optimizer.decay_steps": positive_int(),
    "optimizer.grad_clip_max_norm": nonnegative(),
    "training.max_steps": positive_int(),
    "training.chunk_steps": positive_int(),
    "training.checkpoint_every": positive_int(),
    "training.devices": positive_int(),
    "training.max_consecutive_skips": (lambda v: v >= 0, "an integer >= 0 (0: never stop early)"),
    "eval.grid": (lambda v: v >= 2, "an integer >= 2"),
    "model.frequencies": (
        lambda v: _frequencies_ok(v),
        "a Modulus frequency spec: [axis|diagonal|full, [f0, f1, ...]] or [gaussian, sigma, n]",
    ),
}


def _frequencies_ok(spec: Any) -> bool:
    """Whether jaxamp.models.FourierNet accepts ``spec`` (its init traced on a 2-D point, nothing computed)."""
    import jax

    net = jaxamp.models.FourierNet(out_features=1, layer_size=4, nr_layers=1, frequencies=tuple(spec))
    try:
        jax.eval_shape(net.init, jax.random.PRNGKey(0), jax.numpy.zeros(2))
    except (ValueError, TypeError):
        return False
    return True


class ConfigError(jaxamp.ConfigError):
    """A bad example config: the message names the key, the value and what is allowed."""


def config_path(name: str) -> str:
    """``name`` may be a path to a YAML file or the stem of a file in ``examples/configs``."""
    if os.path.exists(name):
        return name
    path = os.path.join(CONFIG_DIR, name if name.endswith(".yaml") else name + ".yaml")
    if not os.path.exists(path):
        avail = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
        raise ConfigError(f"config {name!r} not found: give a YAML path or one of {avail}.")
    return path


def _load_chain(name: str, seen: Tuple[str, ...] = ()) -> Tuple[DictConfig, DictConfig]:
    """(root default, merged config) of a config file and its ``base:`` chain."""
    path = os.path.abspath(config_path(name))
    if path in seen:
        raise ConfigError(f"config {name!r}: `base` chain loops ({' -> '.join(seen + (path,))}).")
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config {path!r} must be a mapping of keys to values.")
    base = cfg.pop("base", None)
    if base is None:
        return cfg, cfg
    root, parent = _load_chain(base if os.path.isabs(str(base)) else str(base), seen + (path,))
    return root, OmegaConf.merge(parent, cfg)


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"command-line override(s) {bad} are not allowed: expected key=value, "
                          "e.g. training.max_steps=200.")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except Exception as e:  # omegaconf raises several types for bad dotlists
        raise ConfigError(f"command-line overrides {list(overrides)} could not be parsed: {e}") from None


def load_config(name: str, overrides: Sequence[str] = (),
                checks: Optional[Mapping[str, Check]] = None) -> Dict[str, Any]:
    """Load, merge (file chain, mode preset, overrides) and validate a config; a plain dict."""
    root, cfg = _load_chain(name)
    cli = _parse_overrides(overrides)
    merged = OmegaConf.merge(cfg, cli)
    mode = merged.get("mode", "custom")
    if mode not in MODE_NAMES:
        raise ConfigError(f"mode={mode!r} is not allowed: expected one of {list(MODE_NAMES)}.")
    if mode != "custom":
        merged = OmegaConf.merge(cfg, {"amp": MODES[mode]}, cli)
    out = OmegaConf.to_container(merged, resolve=True)
    if isinstance(out.get("amp"), dict):
        out["amp"] = {**EXAMPLE_AMP_DEFAULTS, **out["amp"]}
    schema = OmegaConf.to_container(root, resolve=True)
    validate(out, schema, {**COMMON_CHECKS, **(checks or {})})
    return out


def _type_ok(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, list):
        return isinstance(value, list)
    if isinstance(default, dict):
        return isinstance(value, dict)
    return True  # a null default accepts any value


def _type_name(default: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(default), "any value")


def validate(cfg: Mapping[str, Any], schema: Mapping[str, Any], checks: Mapping[str, Check], prefix: str = "") -> None:
    """Reject unknown keys, wrong types and impossible values (raises :class:`ConfigError`)."""
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if path == "amp":
            check_amp(value)
            continue
        if key not in schema:
            raise ConfigError(f"{path}={value!r}: unknown key; allowed keys here are {sorted(schema)}.")
        default = schema[key]
        if isinstance(default, dict) and default and isinstance(value, dict):
            validate(value, default, checks, prefix=f"{path}.")
            continue
        if not _type_ok(value, default):
            raise ConfigError(f"{path}={value!r} has the wrong type: expected {_type_name(default)}.")
        if path in checks:
            ok, allowed = checks[path]
            if not ok(value):
                raise ConfigError(f"{path}={value!r} is not allowed: expected {allowed}.")


def check_amp(amp: Any) -> jaxamp.AmpConfig:
    """The ``amp:`` section as an AmpConfig (which validates every key), less the examples'
    own keys (:data:`EXAMPLE_AMP_DEFAULTS`, checked here)."""
    if not isinstance(amp, dict):
        raise ConfigError(f"amp={amp!r} must be a mapping of Modulus amp keys.")
    for key, default in EXAMPLE_AMP_DEFAULTS.items():
        if key in amp and not _type_ok(amp[key], default):
            raise ConfigError(f"amp.{key}={amp[key]!r} has the wrong type: expected {_type_name(default)}.")
    return jaxamp.AmpConfig.from_dict({k: v for k, v in amp.items() if k not in EXAMPLE_AMP_DEFAULTS})


def amp_settings(cfg: Mapping[str, Any]) -> Tuple[jaxamp.AmpConfig, bool]:
    """(AmpConfig, do the derivative scalers act?) of a validated config."""
    amp = check_amp(cfg["amp"])
    return amp, amp.scaler_enabled


def to_yaml(cfg: Mapping[str, Any]) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(dict(cfg)))
