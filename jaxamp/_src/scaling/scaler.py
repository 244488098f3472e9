"""The dynamic scale rule (docs/algorithm.md, "Scale update") of the derivative scalers, which
scale seeds *down* (max 1), and of the loss scaler (:func:`loss_scaler`), which scales losses *up*.
:class:`Scalers` pairs each derivative scaler key with its rule and its state.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from types import MappingProxyType
from typing import Any, Dict, Iterator, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

__all__ = [
    "SMALLEST_NORMAL", "LOSS_SCALER_DEFAULTS", "ScaleState", "DynamicScaler", "ScalerArgumentError", "loss_scaler",
    "Scalers", "exact_log2"
]

SMALLEST_NORMAL = 2.0**-126  # float32; the hard floor of every scale
# The loss scaler's defaults where they differ from DynamicScaler's (docs/algorithm.md, "Defaults").
LOSS_SCALER_DEFAULTS = MappingProxyType({"init_scale": 2.0**16, "max_scale": 2.0**30, "recover_threshold": 2.0**7})


class ScalerArgumentError(Exception):
    """A :class:`DynamicScaler` hyper-parameter that is not allowed, kept as its parts so that a
    caller can name the fields its own way (:meth:`describe`): ``amp.loss_scaler.init_scale``
    where an ``AmpConfig`` set it. Raised as :class:`ScalerTypeError` (the wrong kind) or
    :class:`ScalerValueError` (out of range or out of order).

    Attributes:
      field: the field's name. value: its value. expected: what is allowed (``other`` None).
      other, other_value, why: the field it must not exceed, its value, and how to fix the order.
    """

    def __init__(self, field: str, value: Any, expected: str = "", other: Optional[str] = None,
                 other_value: Any = None, why: str = "") -> None:
        self.field, self.value, self.expected = field, value, expected
        self.other, self.other_value, self.why = other, other_value, why
        super().__init__(self.describe() + ".")

    def describe(self, name=lambda field: f"DynamicScaler: `{field}`") -> str:
        """The message, each field written as ``name(field)``."""
        if self.other is None:
            return f"{name(self.field)}={self.value!r} is not allowed: expected {self.expected}"
        other = name(self.other).split(": ")[-1]
        return f"{name(self.field)}={self.value!r} must not exceed {other}={self.other_value!r}{self.why}"


class ScalerTypeError(ScalerArgumentError, TypeError):
    """A hyper-parameter of the wrong kind (a string, a bool, a float interval)."""


class ScalerValueError(ScalerArgumentError, ValueError):
    """A hyper-parameter out of its range, or above the one it must not exceed."""


class ScaleState(NamedTuple):
    """State of one dynamic scaler. A pytree of two scalars."""

    scale: jax.Array  # f32[]: current scale
    growth_tracker: jax.Array  # i32[]: clean steps since the last change of scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicScaler:
    """Growth/backoff scale rule with a max scale and a faster "recover" growth.

    The field defaults are the derivative scalers' (the loss scaler's: :func:`loss_scaler`).
    ``update(state, found_inf)``: on ``found_inf`` ``scale *= backoff_factor`` and the tracker
    resets; otherwise the tracker counts the clean step, and when it *equals* the growth interval
    (``recover_growth_interval`` while ``scale <= recover_threshold``) the scale grows by
    ``growth_factor``, capped at ``max_scale``, and the tracker resets. Backoff stops at
    :attr:`floor` (XLA flushes subnormals to zero, and a zero scale could never grow back).

    Args:
      init_scale: the first scale, in ``(0, max_scale]``. max_scale: the cap of growth, ``> 0``.
      growth_factor: finite, ``> 1``. backoff_factor: in ``(0, 1)``.
      growth_interval: clean steps between two growths, a positive integer.
      recover_threshold: at or below this scale, growth uses ``recover_growth_interval``
        (a positive integer ``<= growth_interval``).
      min_scale: optional floor of backoff, in ``(0, init_scale]``.

    Example:
      >>> from jaxamp._src.scaling.scaler import DynamicScaler
      >>> rule = DynamicScaler(max_scale=4.0, growth_interval=2, recover_growth_interval=2)
      >>> state = rule.update(rule.init(), True)  # an overflow: back off
      >>> float(state.scale)
      0.5
      >>> state = rule.update(rule.update(state, False), False)  # two clean steps: grow
      >>> float(state.scale), int(state.growth_tracker)
      (1.0, 0)
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
        positive, interval = ("a finite number > 0", lambda v: v > 0), ("a positive integer", lambda v: v > 0)
        checks = {"init_scale": positive,
                  "growth_factor": ("a finite number > 1 (the scale grows by it)", lambda v: v > 1),
                  "backoff_factor": ("a number in (0, 1) (the scale shrinks by it)", lambda v: 0 < v < 1),
                  "max_scale": positive, "recover_threshold": positive, "growth_interval": interval,
                  "recover_growth_interval": interval}
        orders = [("init_scale", "max_scale", "; raise max_scale or lower init_scale"),  # (small, large, why)
                  ("recover_threshold", "max_scale", ""),
                  ("recover_growth_interval", "growth_interval", " (recover mode grows faster, not slower)")]
        if self.min_scale is not None:
            checks["min_scale"] = (f"None or a finite number in (0, init_scale={self.init_scale!r}]", lambda v: v > 0)
            orders[:0] = [("min_scale", "max_scale", ""), ("min_scale", "init_scale", "")]
        for name, (allowed, ok) in checks.items():  # the wrong kind: TypeError; out of range: ValueError
            value, kind = getattr(self, name), numbers.Integral if name.endswith("_interval") else numbers.Real
            wrong = isinstance(value, bool) or not isinstance(value, kind)
            if wrong or not math.isfinite(value) or not ok(value):
                raise (ScalerTypeError if wrong else ScalerValueError)(name, value, allowed)
        for small, large, why in orders:
            a, b = getattr(self, small), getattr(self, large)
            if a > b:
                raise ScalerValueError(small, a, other=large, other_value=b, why=why)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, int(value) if f.type == "int" else float(value))

    @property
    def floor(self) -> float:
        """The lowest scale a backoff reaches: ``max(min_scale, 2**-126)``."""
        return SMALLEST_NORMAL if self.min_scale is None else max(self.min_scale, SMALLEST_NORMAL)

    def init(self) -> ScaleState:
        """The initial :class:`ScaleState` ``(init_scale, 0)`` (float32 scale, int32 tracker)."""
        return ScaleState(scale=jnp.asarray(self.init_scale, jnp.float32), growth_tracker=jnp.asarray(0, jnp.int32))

    def update(self, state: ScaleState, found_inf: jax.Array) -> ScaleState:
        """One step of the rule. Pure and branch-free: works under ``jit`` and ``vmap``.

        Args:
          state: the current state. found_inf: ``bool[]``, the step this scale guarded overflowed.

        Returns:
          The next state.
        """
        found_inf = jnp.asarray(found_inf, bool)
        scale = jnp.asarray(state.scale, jnp.float32)
        backed_off = jnp.maximum(scale * jnp.float32(self.backoff_factor), jnp.float32(self.floor))
        n = jnp.asarray(state.growth_tracker, jnp.int32) + 1
        recover = scale <= jnp.float32(self.recover_threshold)
        grow = n == jnp.where(recover, self.recover_growth_interval, self.growth_interval)
        grown = jnp.minimum(scale * jnp.float32(self.growth_factor), jnp.float32(self.max_scale))
        new_scale = jnp.where(found_inf, backed_off, jnp.where(grow, grown, scale))
        new_tracker = jnp.where(found_inf | grow, jnp.int32(0), n)
        return ScaleState(scale=new_scale, growth_tracker=new_tracker)


def loss_scaler(**overrides: Any) -> DynamicScaler:
    """The weight-gradient loss scaler: :data:`LOSS_SCALER_DEFAULTS` over :class:`DynamicScaler`'s
    defaults, then ``overrides``.

    Example:
      >>> from jaxamp._src.scaling.scaler import loss_scaler
      >>> loss_scaler(growth_interval=500).init_scale
      65536.0
    """
    return DynamicScaler(**{**LOSS_SCALER_DEFAULTS, **overrides})


@jax.tree_util.register_pytree_with_keys_class
class Scalers(Mapping[str, ScaleState]):
    """The derivative scalers of a run: each scaler key paired with its rule and its state.

    A read-only mapping ``{key: ScaleState}``, and a pytree like a dict of states (same key
    paths) whose rules are static.

    Args:
      rules: ``{key: DynamicScaler}``.
      states: ``{key: ScaleState}`` with the same keys (default: each rule's ``init()``).

    Example:
      >>> import jaxamp
      >>> s = jaxamp.init(None, jaxamp.AmpConfig(), keys=["1", "2"])().derivative  # a Scalers
      >>> s = s.update({"2": True})
      >>> float(s["2"].scale), float(s["1"].scale)
      (0.5, 1.0)
    """

    def __init__(self, rules: Mapping[str, DynamicScaler], states: Optional[Mapping[str, ScaleState]] = None) -> None:
        for key, rule in rules.items():
            if not isinstance(key, str) or not isinstance(rule, DynamicScaler):
                raise TypeError(f"Scalers: `rules` must map str keys to DynamicScaler, got {key!r}: {rule!r}.")
        states = {k: r.init() for k, r in rules.items()} if states is None else dict(states)
        if set(states) != set(rules):
            raise KeyError(f"Scalers: `states` has keys {sorted(states)}; the rules have {sorted(rules)}.")
        self._rules = dict(rules)
        self._states = {k: states[k] for k in self._rules}

    @property
    def rules(self) -> Mapping[str, DynamicScaler]:
        """``{key: DynamicScaler}`` (read-only)."""
        return MappingProxyType(self._rules)

    @property
    def scales(self) -> Dict[str, jax.Array]:
        """``{key: f32[]}``: the current scales, as a derivative engine takes them."""
        return {k: s.scale for k, s in self._states.items()}

    def update(self, found_inf: Mapping[str, jax.Array]) -> "Scalers":
        """Every scaler steps with its own flag (a key missing from ``found_inf`` had a clean step).

        Args:
          found_inf: ``{key: bool[]}``; every key must be one of these scalers'.

        Returns:
          The updated :class:`Scalers`.
        """
        unknown = sorted(k for k in found_inf if k not in self._rules)
        if unknown:
            raise KeyError(f"Scalers.update: `found_inf` has key(s) {unknown} with no scaler; keys are {sorted(self)}.")
        states = {k: r.update(self._states[k], found_inf.get(k, False)) for k, r in self._rules.items()}
        return Scalers(self._rules, states)

    def __getitem__(self, key: str) -> ScaleState:
        return self._states[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def __repr__(self) -> str:
        return f"Scalers({self._states!r})"

    def tree_flatten_with_keys(self) -> Tuple[list, Tuple[Tuple[str, DynamicScaler], ...]]:
        children = [(jax.tree_util.DictKey(k), s) for k, s in self._states.items()]
        return children, tuple(self._rules.items())

    @classmethod
    def tree_unflatten(cls, aux: Tuple[Tuple[str, DynamicScaler], ...], children: list) -> "Scalers":
        rules = dict(aux)
        return cls(rules, dict(zip(rules, children)))


def exact_log2(x: jax.Array) -> jax.Array:
    """``log2(x)`` that is exact for powers of two (``jnp.log2`` may give 14.999999 for 2**15).

    Args:
      x: positive float32 values.

    Returns:
      ``log2(x)`` as float32.
    """
    mantissa, exponent = jnp.frexp(jnp.asarray(x, jnp.float32))
    return (exponent - 1).astype(jnp.float32) + jnp.log2(2 * mantissa)
