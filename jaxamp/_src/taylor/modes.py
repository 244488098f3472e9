"""The two entry points of Taylor mode: :func:`series` and :func:`second_order`."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import jax

from jaxamp._src.core.marks import seed
from jaxamp._src.taylor.faa_di_bruno import Ratio, Scales, series_rule
from jaxamp._src.taylor.propagate import propagate

__all__ = ["second_order", "series"]


def series(f: Callable[[jax.Array], jax.Array], x: jax.Array, direction: jax.Array, order: int,
           scales: Optional[Sequence[jax.Array]] = None) -> Tuple[jax.Array, List[jax.Array]]:
    """Pure derivatives of ``f`` along ``direction``, orders ``1..order``, each scaled.

    Equal, up to rounding, to ``order`` nested ``jax.jvp`` with seeds ``S_1 e`` then
    ``(S_k / S_{k-1}) e``; an order's chain overflows when that order's scaled value does.

    Args:
      f: a function of one array returning one array; it may close over traced values.
      x: the point.
      direction: ``e``, with ``x``'s shape.
      order: ``K >= 1``.
      scales: ``S_1..S_K``, float32 scalars (powers of two for DerivScaler), or None (all 1).

    Returns:
      ``(f(x), [S_1 df[e], S_2 d2f[e, e], ..., S_K dKf[e, ..., e]])``, each in ``f(x)``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp._src.taylor import series
      >>> y, (d1, d2, d3) = series(jnp.sin, jnp.float32(0.5), jnp.float32(1.0), 3)
      >>> bool(jnp.allclose(d3, -jnp.cos(0.5)))
      True
    """
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ValueError(f"jaxamp._src.taylor.series: `order`={order!r} must be an integer >= 1.")
    if scales is not None and len(scales) != order:
        raise ValueError(f"jaxamp._src.taylor.series: got {len(scales)} scales for order {order}; "
                         "pass one per order (S_1, ..., S_K) or None.")
    scaling = None if scales is None else Scales(scales)
    first = seed(direction, scaling.scales[0] if scaling is not None else 1.0, x.dtype)
    return propagate(f, x, (first,) + (None,) * (order - 1), series_rule(scaling, order))


def second_order(f: Callable[[jax.Array], jax.Array], x: jax.Array, tangent: jax.Array,
                 ratio: Union[None, jax.Array, Sequence[jax.Array]]) -> Tuple[jax.Array, ...]:
    """``f(x)``, ``df[t]`` and ``d2f[t, ratio * t]`` (``t = tangent``, carrying ``S_1``):
    :func:`series` of order 2 with the ratio ``S_2 / S_1**2``, one tangent chain instead of
    nested ``jax.jvp``'s two.

    Args:
      f: a function of one array returning one array; it may close over traced values.
      x: the point.
      tangent: ``t``, with ``x``'s shape.
      ratio: a float32 scalar, or factors applied one after another (``(S_2 / S_1, 1 / S_1)``),
        or None for ``d2f[t, t]``.

    Returns:
      ``(f(x), df[t], d2f[t, ratio * t])`` in ``f(x)``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp._src.taylor import second_order
      >>> y, d1, d2 = second_order(jnp.sin, jnp.float32(0.5), jnp.float32(2.0), jnp.float32(0.25))
      >>> bool(jnp.allclose(d2, -jnp.sin(0.5)))
      True
    """
    factors = ratio if isinstance(ratio, (tuple, list)) else (ratio,)
    scaling = None if ratio is None else Ratio(factors)
    y, (first, second) = propagate(f, x, (tangent, None), series_rule(scaling, 2))
    return y, first, second
