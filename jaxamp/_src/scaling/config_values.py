"""How config values arrive (a dtype object, a ConfigDict, an omegaconf node) as plain values, and
the checks each kind of value gets (a bad one is a :class:`ConfigError` naming key, value and what
is allowed)."""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Iterator, Mapping, Tuple, Union

import jax.numpy as jnp

__all__ = ["DTYPE_NAMES", "ROLES", "FP8_FORMATS", "LOG2_RANGE", "FLOAT8_ROLE_FORMATS", "ConfigError", "check_flags",
           "fail", "check_log2", "scaler_overrides", "float8_formats", "per_key", "mapping_like", "dtype_name", "plain",
           "FrozenMapping"]

DTYPE_NAMES = ("float16", "bfloat16", "float32")  # dtype objects a config accepts by name
FLOAT8_ROLE_FORMATS = ("float16", "float8_e4m3fn", "float8_e5m2")  # a float8 matmul operand's format per role
# A matmul operand's role (jaxamp/_src/placement/tensor_scale.py).
ROLES = ("value", "tangent", "cotangent")
# The FP8 recipe's operand formats per role: the network's values keep float16's 10 mantissa
# bits, and so do the derivative tangents (E4M3 tangents cost 5-8x fp32's error on a second-order
# PINN); the cotangents (the backward passes: two matmuls for each forward one) take E4M3
# under their per-tensor scales: the best recipe measured (docs/tensor_scaling.md).
FP8_FORMATS = ("float16", "float16", "float8_e4m3fn")


class FrozenMapping(Mapping[str, Any]):
    """A read-only ``{str: value}`` in sorted key order: a config's mapping-valued field.

    Equal to any mapping with the same items (a ``dict`` included); hashable, with equal mappings
    hashing equal whatever order their items came in; pickles and deep-copies (a ``mappingproxy``
    does neither); its repr is the ``dict``'s.

    Example:
      >>> a, b = FrozenMapping({"nu": 20, "2": 3}), FrozenMapping({"2": 3, "nu": 20})
      >>> a == b == {"2": 3, "nu": 20} and hash(a) == hash(b), a
      (True, {'2': 3, 'nu': 20})
    """

    __slots__ = ("_items",)

    def __init__(self, items: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]] = ()) -> None:
        self._items = dict(sorted(dict(items).items()))

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __reduce__(self) -> Tuple[type, Tuple[dict]]:
        return type(self), (dict(self._items),)

    def __repr__(self) -> str:
        return repr(self._items)


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


# float32's exponent range: a max scale of 2**k must be a normal, finite float32.
LOG2_RANGE = (-126, 127)


class ConfigError(ValueError):
    """A bad configuration value. The message names the key, the value and what is allowed."""


def check_flags(caller: str, **flags: Any) -> None:
    """Raise a TypeError naming the first of the arguments ``flags`` that is not True or False."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{caller}: `{name}`={flag!r} must be True or False.")


def fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"amp.{key}={value!r} is not allowed: expected {allowed}.")


def check_log2(key: str, value: Any, what: str = "max scale") -> None:
    lo, hi = LOG2_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        fail(key, value, f"an integer exponent in [{lo}, {hi}] ({what} = 2**value)")


def scaler_overrides(amp: Any, key: str, allowed_keys: Tuple[str, ...]) -> None:
    """Validate ``amp.<key>`` {hyper-parameter: value} (any mapping-like value), store it read-only."""
    value = plain(getattr(amp, key))
    if not isinstance(value, Mapping):
        fail(key, value, f"a mapping with keys among {list(allowed_keys)}")
    for name in value:
        if name not in allowed_keys:
            fail(f"{key}.{name}", value[name], f"one of the keys {list(allowed_keys)} (unknown key)")
    object.__setattr__(amp, key, FrozenMapping({name: _number(name, v) for name, v in value.items()}))


def _number(name: str, value: Any) -> Any:
    """A hyper-parameter as the scaler stores it (1024 and np.float32(1024) -> 1024.0, intervals int),
    so that equal settings print and hash alike; a value of the wrong kind stays for the scaler's check."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if name.endswith("_interval"):
        return int(value) if isinstance(value, numbers.Integral) else value
    try:
        return float(value)
    except OverflowError:  # an int too large for a float: the scaler's check names it
        return value


def float8_formats(amp: Any) -> None:
    """Validate ``amp.float8_formats`` {role: format} (float8 only), store it read-only."""
    value = plain(amp.float8_formats)
    if not isinstance(value, Mapping):
        fail("float8_formats", value, f"a mapping {{role: format}} with roles among {list(ROLES)}")
    for role, fmt in value.items():
        if role not in ROLES:
            fail(f"float8_formats.{role}", fmt, f"one of the roles {list(ROLES)} (unknown role)")
        if fmt not in FLOAT8_ROLE_FORMATS:
            fail(f"float8_formats.{role}", fmt, f"one of {list(FLOAT8_ROLE_FORMATS)}")
    if value and amp.dtype != "float8":
        fail("float8_formats", value,
             f'{{}} with dtype {amp.dtype!r} (the formats are the float8 recipe\'s: set dtype "float8")')
    object.__setattr__(amp, "float8_formats", FrozenMapping(value))


def per_key(amp: Any, field: str, what: str) -> Mapping[str, int]:
    """Validate ``amp.<field>`` ``{order or term name: int exponent}`` (any mapping-like value), store it
    read-only with str keys."""
    value = plain(getattr(amp, field))
    if not isinstance(value, Mapping):
        fail(field, value, "a mapping {key: int}")
    for key, exp in value.items():
        check_log2(f"{field}[{key!r}]", exp, what)
    for key in value:
        if isinstance(key, bool) or not isinstance(key, (int, str)) or str(key) == "":
            fail(field, key, "keys that are an order (int >= 1) or a term name (str)")
        if isinstance(key, int) and key < 1:
            fail(field, key, "an order >= 1")
    object.__setattr__(amp, field, FrozenMapping({str(k): int(v) for k, v in value.items()}))
    return getattr(amp, field)
