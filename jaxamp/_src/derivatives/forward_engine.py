"""The forward engine (``method="forward"``, the default; docs/algorithm.md, "Engines").

Step k of a path is ``jax.jvp`` of the *scaled* level below with the seed ``s_k / s_{k-1}``, so no
float16 value carries ``s_{k-1} s_k``. One pass per maximal path; paths differing only in keys share
one at the smallest scales (:func:`shared_scales`, :func:`as_scaled`). Pure second orders take
:func:`jaxamp._src.taylor.second_order`, pure orders >= ``series_min_order`` :func:`jaxamp._src.taylor.series`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp

from jaxamp._src import taylor
from jaxamp._src.derivatives.plan import Path, Plan, parse_name
from jaxamp._src.core.marks import unscale

__all__ = ["SERIES_MIN_ORDER", "Levels", "Chain", "point_values", "passes", "pass_cost", "Passes", "shared_scales",
           "as_scaled"]

# Pure derivatives of at least this order take Taylor mode (jaxamp._src.taylor.series); pure
# second orders take jaxamp._src.taylor.second_order.
SERIES_MIN_ORDER = 3

Direction = Tuple[Tuple[int, ...], Tuple[jax.Array, ...]]  # (entries of the point, their factors)
Levels = Tuple[List[jax.Array], List[jax.Array]]  # (unscaled [y, d1, ..., dk], scaled [d1, ..., dk])
Chain = Callable[[jax.Array, Sequence[jax.Array]], Tuple[jax.Array, Levels]]


def point_values(plan: Plan, f: Callable[[jax.Array], jax.Array], x: jax.Array, scales: Mapping[str, jax.Array], *,
                 series_min_order: int = SERIES_MIN_ORDER, directions: Sequence[Direction] = ()
                 ) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:
    """Every value of ``plan`` at one point by nested forward mode: ``(values, scaled)``, each
    value unscaled and each derivative's last step scaled.

    ``f`` maps the point ``x`` (``f32[n_inputs]``, or a tuple of float32 scalars: the drop-in's
    chains) to ``f32[n_outputs]``; ``scales`` is ``{key: f32[]}`` for ``plan.step_keys``. For a
    tuple ``x``, the plan's inputs after ``x``'s are ``directions``: ``(entries of x, their
    float32 factors)``, a step along one a tangent along that line (``jax.jvp``'s direction).
    """
    groups = passes(plan.maximal_paths(), lambda path: tuple(col for _, col in path))
    results: Dict[Path, Levels] = {}
    for cols, paths in groups.items():
        chain = _chain(f, cols, series_min_order, tuple(directions))
        per_path = [[scales[key] for key, _ in path] for path in paths]
        if len(paths) == 1:
            results[paths[0]] = chain(x, per_path[0])[1]
            continue
        unscaled, _ = chain(x, shared_scales(per_path))[1]
        for path, s in zip(paths, per_path):
            results[path] = (unscaled, [as_scaled(u, sk) for u, sk in zip(unscaled[1:], s)])
    row = {name: i for i, name in enumerate(plan.outputs)}
    values: Dict[str, jax.Array] = {}
    scaled_values: Dict[str, jax.Array] = {}
    for name in plan.derivatives:
        path = plan.paths[name]
        levels, scaled = next(r for m, r in results.items() if m[: len(path)] == path)
        i = row[parse_name(name)[0]]
        values[name], scaled_values[name] = levels[len(path)][i], scaled[len(path) - 1][i]
    y = next(iter(results.values()))[0][0] if results else f(x)
    values.update({name: y[i] for name, i in row.items()})
    return values, scaled_values


def passes(paths: Sequence[Any], cols_of: Callable[[Any], Tuple[Any, ...]] = tuple) -> Dict[Tuple[Any, ...], List[Any]]:
    """``{inputs of a pass: the paths it computes}``: longest first, a path along a prefix of
    another's inputs joins that pass (``cols_of(path)``: the inputs it steps along, in order)."""
    groups: Dict[Tuple[Any, ...], List[Any]] = {}
    for path in sorted(paths, key=lambda p: len(cols_of(p)), reverse=True):
        cols = cols_of(path)
        home = next((g for g in groups if g[: len(cols)] == cols), cols)
        groups.setdefault(home, []).append(path)
    return groups


def _taylor(cols: Sequence[Any], series_min_order: int) -> bool:
    """Whether the pass along ``cols`` is a pure derivative :func:`_pure` computes (Taylor mode
    or a pure second order), not a jvp of the pass along ``cols[:-1]``."""
    return all(col == cols[0] for col in cols) and (len(cols) >= series_min_order or len(cols) == 2)


def pass_cost(cols: Sequence[Any], series_min_order: int = SERIES_MIN_ORDER) -> int:
    """The values per network value a pass along ``cols`` carries (its FLOPs, in the network's
    evaluations): a Taylor series of order k carries k + 1 coefficients, a pure second order
    3, a jvp twice the pass below (:func:`_chain`)."""
    if not cols:
        return 1
    if _taylor(cols, series_min_order):
        return len(cols) + 1
    return 2 * pass_cost(cols[:-1], series_min_order)


class Passes:
    """The passes of a plan as paths join it one by one, as :func:`passes` groups them: the
    inputs of each pass (``homes``), every prefix of them, and what they carry (``cost``, the
    sum of their :func:`pass_cost`: the same whatever order the paths join in)."""

    def __init__(self, series_min_order: int = SERIES_MIN_ORDER) -> None:
        self.homes: set = set()
        self.prefixes: set = set()
        self.cost = 0
        self.series_min_order = series_min_order

    def extra(self, path: Tuple[Any, ...]) -> int:
        """What ``path`` adds: nothing along a prefix of a pass, a pass it extends made longer."""
        if path in self.prefixes:
            return 0
        below = next((path[:k] for k in range(len(path) - 1, 0, -1) if path[:k] in self.homes), ())
        return pass_cost(path, self.series_min_order) - (pass_cost(below, self.series_min_order) if below else 0)

    def add(self, path: Tuple[Any, ...]) -> None:
        self.cost += self.extra(path)
        if path not in self.prefixes:
            self.homes.difference_update(path[:k] for k in range(1, len(path)))
            self.homes.add(path)
            self.prefixes.update(path[:k] for k in range(1, len(path) + 1))


def shared_scales(per_path: Sequence[Sequence[jax.Array]]) -> List[jax.Array]:
    """The step scales of one chain shared by paths along the same inputs: each step's seed ratio
    is the smallest of theirs, so if the shared chain overflows, so would each path's own."""
    shared: List[jax.Array] = []
    for k in range(max(len(p) for p in per_path)):  # shorter paths constrain their steps only
        ratios = [p[k] / p[k - 1] if k else p[k] for p in per_path if len(p) > k]
        ratio = functools.reduce(jnp.minimum, ratios)
        shared.append(ratio * shared[-1] if k else ratio)
    return shared


def as_scaled(value: jax.Array, scale: jax.Array) -> jax.Array:
    """``value * scale`` as float16 holds it (inf beyond its range): a path's scaled result from
    a shared chain's unscaled value (exact: the scales are powers of two)."""
    return (value * scale).astype(jnp.float16).astype(jnp.float32)


def _line(g: Callable, x: Any, col: int, t: jax.Array, directions: Sequence[Direction] = ()
          ) -> Tuple[Callable, jax.Array, jax.Array]:
    """``(fn, primal, tangent)``: a tangent ``t`` along input ``col`` of the point ``x``. For a tuple
    of scalars (the drop-in's chains), ``g`` restricted to that input (a direction, ``col`` past
    ``x``'s inputs: to the entries it moves, stacked, the tangent ``t`` times its factors); for
    ``f32[n_inputs]`` (the engine), ``g`` itself and a basis tangent, so that no pass stacks its input."""
    if isinstance(x, tuple) and col >= len(x):
        at, factors = directions[col - len(x)]

        def along(z):
            return g(tuple(z[at.index(i)] if i in at else xi for i, xi in enumerate(x)))

        return along, jnp.stack([x[i] for i in at]), t * jnp.stack([jnp.asarray(v, jnp.float32) for v in factors])
    if isinstance(x, tuple):
        return (lambda xc: g(x[:col] + (xc,) + x[col + 1 :])), x[col], t
    return g, x, jnp.zeros_like(x).at[col].set(t)


def _chain(f: Callable, cols: Tuple[int, ...], series_min_order: int, directions: Tuple[Direction, ...] = ()) -> Chain:
    """``chain(x, s) -> (scaled top, (unscaled levels, scaled levels))`` along inputs ``cols``."""
    one = jnp.float32(1.0)
    if not cols:

        def outputs(x, s):
            y = f(x)
            return y, ([y], [])

        return outputs
    if _taylor(cols, series_min_order):
        return _pure(f, cols[0], len(cols) >= series_min_order, directions)
    below, col = _chain(f, cols[:-1], series_min_order, directions), cols[-1]

    def chain(x, s):
        seed = s[-1] / (s[-2] if len(s) > 1 else one)  # s_k / s_{k-1}
        fn, primal, tangent = _line(lambda z: below(z, s[:-1]), x, col, seed, directions)
        _, top, (unscaled, scaled) = jax.jvp(fn, (primal,), (tangent,), has_aux=True)
        return top, (unscaled + [unscale(top, one / s[-1])], scaled + [top])

    return chain


def _pure(f: Callable, col: int, series: bool, directions: Tuple[Direction, ...] = ()) -> Chain:
    """The chain of a pure derivative along input ``col``: Taylor mode, each order at its own scale
    (``series``), or a pure second derivative (``u__x__x``) as one propagated tangent."""
    one = jnp.float32(1.0)

    def chain(x, s):
        if series:
            y, scaled = taylor.series(*_line(f, x, col, one, directions), len(s), list(s))
        else:  # outer seed s2/s1 over inner seed s1, as two factors: s1**2 may underflow float32
            y, *scaled = taylor.second_order(*_line(f, x, col, s[0], directions), (s[1] / s[0], one / s[0]))
        return scaled[-1], ([y] + [unscale(d, one / sk) for d, sk in zip(scaled, s)], list(scaled))

    return chain
