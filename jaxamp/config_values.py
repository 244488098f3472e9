"""How config values arrive (a dtype object, a ConfigDict, an omegaconf node) as plain values."""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

__all__ = ["DTYPE_NAMES", "mapping_like", "dtype_name", "plain"]

DTYPE_NAMES = ("float16", "bfloat16", "float32")  # dtype objects a config accepts by name


def mapping_like(value: Any) -> bool:  # ml_collections' ConfigDict has keys() and [] but is not a Mapping
    return isinstance(value, Mapping) or (hasattr(value, "keys") and hasattr(value, "__getitem__"))


def dtype_name(value: Any) -> Any:
    """The name of a float16/bfloat16/float32 dtype object (jnp.float16, np.dtype("float16")); else ``value``."""
    try:
        name = value if isinstance(value, str) else jnp.dtype(value).name
    except (TypeError, ValueError):
        return value
    return name if name in DTYPE_NAMES else value


def plain(value: Any) -> Any:
    """Nested plain dicts and lists from any mapping-like config (dict, ConfigDict, DictConfig)."""
    if hasattr(value, "_metadata") and type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        value = OmegaConf.to_container(value, resolve=True)
    if mapping_like(value):
        return {k: plain(value[k]) for k in value.keys()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [plain(v) for v in value]
    return value
