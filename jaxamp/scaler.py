"""The dynamic scale rule shared by the derivative scalers and the loss scaler.

One rule (SPEC.md, "The scale update") serves both families; only the defaults
differ: :func:`derivative_scaler` scales derivative seeds *down* (max 1) and
:func:`loss_scaler` scales the loss *up* against weight-gradient underflow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


SMALLEST_NORMAL = 2.0**-126  # float32; the hard floor of every scale


class ScaleState(NamedTuple):
    """State of one dynamic scaler. A pytree of two scalars."""

    scale: jax.Array  # f32[]: current scale
    growth_tracker: jax.Array  # i32[]: clean steps since the last change of scale


def _check_positive(name: str, value: float, *, integer: bool = False) -> None:
    kind = "a positive integer" if integer else "a positive finite number"
    if isinstance(value, bool) or (integer and not isinstance(value, int)):
        raise TypeError(f"DynamicScaler: `{name}`={value!r} must be {kind}.")
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"DynamicScaler: `{name}`={value!r} must be {kind}.")


@dataclasses.dataclass(frozen=True)
class DynamicScaler:
    """Growth/backoff scale rule with a max scale and a faster "recover" growth.

    After each step, ``update(state, found_inf)``:

    - ``found_inf``: ``scale *= backoff_factor``, tracker reset;
    - otherwise the tracker counts the clean step; when it *equals* the growth interval
      (``recover_growth_interval`` while ``scale <= recover_threshold``, else
      ``growth_interval``) the scale grows by ``growth_factor``, capped at ``max_scale``,
      and the tracker resets.

    ``min_scale`` (default None: no floor, as Modulus) optionally bounds the backoff. In any
    case the scale never backs off below float32's smallest normal number, 2**-126: XLA
    flushes subnormals to zero, and a zero scale could never grow back (0 * 2 = 0).
    All hyper-parameters are keyword-only and validated at construction.
    """

    init_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    max_scale: float = 1.0
    recover_threshold: float = 2.0**-6
    recover_growth_interval: int = 100
    min_scale: Optional[float] = None

    def __init__(
        self,
        *,
        init_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        max_scale: float = 1.0,
        recover_threshold: float = 2.0**-6,
        recover_growth_interval: int = 100,
        min_scale: Optional[float] = None,
    ) -> None:
        for name, value in (
            ("init_scale", init_scale),
            ("growth_factor", growth_factor),
            ("backoff_factor", backoff_factor),
            ("max_scale", max_scale),
            ("recover_threshold", recover_threshold),
        ):
            _check_positive(name, value)
        _check_positive("growth_interval", growth_interval, integer=True)
        _check_positive("recover_growth_interval", recover_growth_interval, integer=True)
        if init_scale > max_scale:
            raise ValueError(
                f"DynamicScaler: `init_scale`={init_scale!r} must not exceed `max_scale`={max_scale!r}; "
                "raise max_scale or lower init_scale."
            )
        if recover_threshold > max_scale:
            raise ValueError(
                f"DynamicScaler: `recover_threshold`={recover_threshold!r} must not exceed "
                f"`max_scale`={max_scale!r}."
            )
        if recover_growth_interval > growth_interval:
            raise ValueError(
                f"DynamicScaler: `recover_growth_interval`={recover_growth_interval!r} must not exceed "
                f"`growth_interval`={growth_interval!r} (recover mode grows faster, not slower)."
            )
        if min_scale is not None:
            _check_positive("min_scale", min_scale)
            if min_scale > init_scale:
                raise ValueError(
                    f"DynamicScaler: `min_scale`={min_scale!r} must not exceed `init_scale`={init_scale!r}."
                )
        values = dict(
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=growth_interval,
            max_scale=float(max_scale),
            recover_threshold=float(recover_threshold),
            recover_growth_interval=recover_growth_interval,
            min_scale=None if min_scale is None else float(min_scale),
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def init(self) -> ScaleState:
        """The initial state: ``(init_scale, 0)``."""
        return ScaleState(
            scale=jnp.asarray(self.init_scale, jnp.float32),
            growth_tracker=jnp.asarray(0, jnp.int32),
        )

    def update(self, state: ScaleState, found_inf: jax.Array) -> ScaleState:
        """One step of the rule. Pure and branch-free: works under ``jit`` and ``vmap``."""
        found_inf = jnp.asarray(found_inf, bool)
        scale = jnp.asarray(state.scale, jnp.float32)
        tracker = jnp.asarray(state.growth_tracker, jnp.int32)

        floor = SMALLEST_NORMAL if self.min_scale is None else max(self.min_scale, SMALLEST_NORMAL)
        backed_off = jnp.maximum(scale * jnp.float32(self.backoff_factor), jnp.float32(floor))

        n = tracker + 1
        interval = jnp.where(
            scale <= jnp.float32(self.recover_threshold),
            jnp.int32(self.recover_growth_interval),
            jnp.int32(self.growth_interval),
        )
        grow = n == interval
        grown = jnp.minimum(scale * jnp.float32(self.growth_factor), jnp.float32(self.max_scale))

        new_scale = jnp.where(found_inf, backed_off, jnp.where(grow, grown, scale))
        new_tracker = jnp.where(found_inf | grow, jnp.int32(0), n)
        return ScaleState(scale=new_scale, growth_tracker=new_tracker)


def derivative_scaler(**overrides) -> DynamicScaler:
    """A derivative scaler with SPEC/Modulus-trainer defaults (init 1, max 1, interval 1000,
    recover below 2^-6 every 100 steps). Keyword overrides are validated as usual."""
    params = dict(
        init_scale=1.0,
        max_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        recover_threshold=2.0**-6,
        recover_growth_interval=100,
    )
    params.update(overrides)
    return DynamicScaler(**params)


def loss_scaler(**overrides) -> DynamicScaler:
    """The weight-gradient (loss) scaler with SPEC/Modulus-trainer defaults (init 2^16,
    max 2^30, interval 1000, recover below 2^7 every 100 steps)."""
    params = dict(
        init_scale=2.0**16,
        max_scale=2.0**30,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        recover_threshold=2.0**7,
        recover_growth_interval=100,
    )
    params.update(overrides)
    return DynamicScaler(**params)


def exact_log2(x: jax.Array) -> jax.Array:
    """``log2(x)`` that is exact for powers of two (``jnp.log2`` may give 14.999999 for 2**15)."""
    mantissa, exponent = jnp.frexp(jnp.asarray(x, jnp.float32))
    return (exponent - 1).astype(jnp.float32) + jnp.log2(2 * mantissa)
