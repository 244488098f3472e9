"""The forward engine (``method="forward"``, the default): nested forward mode per derivative path.

A derivative's path is its sequence of (scaler key, input) steps (:class:`~jaxamp.derivatives.plan.Plan`).
Step k is ``jax.jvp`` of the *scaled* level below, ``s_{k-1} * f`` (as float16 tangents
computed it), along its input with the tangent seed ``s_k / s_{k-1}``: by linearity this is
``s_k * df/dx``, the steps 1-2 of docs/algorithm.md "One derivative step" for the already
unscaled ``f``, and every float16 value of the step carries at most the scale of the step
(``s_k`` or ``s_k / s_{k-1}``, as in nested reverse mode), never the product ``s_{k-1} s_k``.
The scaled tangent is returned for the check (step 3) and multiplied by ``1/s_k`` in float32
(step 4).

One pass per maximal path: its primal outputs are the lower-order values along the path, and
every output's tangent comes out of it, so under per-order scaling ``u__x__x`` and
``v__x__x`` (and ``u__x``, ``p__x``) share one pass. Paths that differ only in their keys
(per-term scaling: ``u__x__x`` and ``v__x__x`` under keys ``u``/``u__x`` and ``v``/``v__x``)
share one pass too, as per-order paths do: its step scales are the smallest of theirs
(:func:`shared_scales`), its unscaled values are every path's values, and each path's scaled
result for the check is that value times the path's own scale, as float16 holds it
(:func:`as_scaled`). A key is flagged when the shared pass overflows (each path's own pass,
at scales no smaller, would too) or when its own scaled result leaves float16's range
(docs/algorithm.md, "Engines").

A pure second-order step (the same input twice) is :func:`jaxamp.taylor.second_order`: one
propagated tangent instead of nested ``jax.jvp``'s two. A pure path of order >=
``series_min_order`` is Taylor mode (:func:`jaxamp.taylor.series`), every order's chain
carrying its own ``s_k``; other paths with a pure second-order prefix are ``jax.jvp`` of the
pure second order. Unscaled engines run this same code with every scale 1.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp

from jaxamp import taylor
from jaxamp.derivatives.plan import Path, Plan, parse_name
from jaxamp.marks import unscale

# Pure derivatives of at least this order take Taylor mode (jaxamp.taylor.series); pure
# second orders take jaxamp.taylor.second_order.
SERIES_MIN_ORDER = 3

Levels = Tuple[List[jax.Array], List[jax.Array]]  # (unscaled [y, d1, ..., dk], scaled [d1, ..., dk])
Chain = Callable[[jax.Array, Sequence[jax.Array]], Tuple[jax.Array, Levels]]


def point_values(plan: Plan, f: Callable[[jax.Array], jax.Array], x: jax.Array, scales: Mapping[str, jax.Array], *,
                 series_min_order: int = SERIES_MIN_ORDER) -> Tuple[Dict[str, jax.Array], Dict[str, jax.Array]]:  # fmt: skip
    """Every value of ``plan`` at one point by nested forward mode.

    Args:
      plan: the engine's plan.
      f: the network at one point, ``x: f32[n_inputs] -> f32[n_outputs]``.
      x: the point, ``f32[n_inputs]``; or a tuple of ``n_inputs`` float32 scalars, ``f`` then
        taking such a tuple (the drop-in's chains pass the user's own arguments, so the primal
        of every pass is the very computation of the user's own call, for
        :func:`jaxamp.interpreter.cse`).
      scales: ``{key: f32[]}`` for every key of ``plan.step_keys``.
      series_min_order: pure derivatives of this order or more take Taylor mode.

    Returns:
      ``(values, scaled)``: ``values[name]`` (unscaled, ``f32[]``) for every output and
      derivative; ``scaled[derivative]`` the scaled result of its last step.
    """
    if not isinstance(x, tuple):  # each step differentiates along one input: the point as scalars
        f, x = _of_vector(f), tuple(x[i] for i in range(len(plan.inputs)))
    groups: Dict[Tuple[int, ...], List[Path]] = {}
    # Longest first: a path along a prefix of another's inputs joins that pass.
    for path in sorted(plan.maximal_paths(), key=len, reverse=True):
        cols = tuple(col for _, col in path)
        home = next((g for g in groups if g[: len(cols)] == cols), cols)
        groups.setdefault(home, []).append(path)
    results: Dict[Path, Levels] = {}
    for cols, paths in groups.items():
        chain = _chain(f, cols, series_min_order)
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


def shared_scales(per_path: Sequence[Sequence[jax.Array]]) -> List[jax.Array]:
    """The step scales of one chain shared by paths along the same inputs (per-term keys).

    Step k's seed ratio is the smallest of the paths' ``s_k / s_{k-1}``, so every float16
    tangent of the shared chain carries a scale no larger than the same tangent of any
    path's own chain: if the shared chain overflows, so would each path's own chain.
    """
    shared: List[jax.Array] = []
    for k in range(max(len(p) for p in per_path)):  # shorter paths constrain their steps only
        ratios = [p[k] / p[k - 1] if k else p[k] for p in per_path if len(p) > k]
        ratio = functools.reduce(jnp.minimum, ratios)
        shared.append(ratio * shared[-1] if k else ratio)
    return shared


def as_scaled(value: jax.Array, scale: jax.Array) -> jax.Array:
    """``value * scale`` as float16 holds it (inf beyond its range): a path's scaled result
    for the overflow check, from the unscaled value of a shared chain (exact: the scales are
    powers of two)."""
    return (value * scale).astype(jnp.float16).astype(jnp.float32)


def _of_vector(f: Callable[[jax.Array], jax.Array]) -> Callable[[Tuple[jax.Array, ...]], jax.Array]:
    return lambda xs: f(jnp.stack(xs))


def _along(g: Callable, x: Tuple[jax.Array, ...], col: int) -> Callable[[jax.Array], Any]:
    """``g`` on the line through the point ``x`` along input ``col``: a function of that input."""
    return lambda xc: g(x[:col] + (xc,) + x[col + 1 :])


def _chain(f: Callable, cols: Tuple[int, ...], series_min_order: int) -> Chain:
    """``chain(x, s) -> (scaled top level, (unscaled levels, scaled levels))`` for the steps
    along the inputs ``cols`` with the step scales ``s`` (one ``f32[]`` per step); ``x`` is a
    tuple of scalars."""
    one = jnp.float32(1.0)
    if not cols:

        def outputs(x, s):
            y = f(x)
            return y, ([y], [])

        return outputs
    pure = all(col == cols[0] for col in cols)
    if pure and len(cols) >= series_min_order:
        return _series(f, cols)
    if pure and len(cols) == 2:
        return _second(f, cols)
    below, col = _chain(f, cols[:-1], series_min_order), cols[-1]

    def chain(x, s):
        seed = s[-1] / (s[-2] if len(s) > 1 else one)  # s_k / s_{k-1}
        _, top, (unscaled, scaled) = jax.jvp(_along(lambda z: below(z, s[:-1]), x, col), (x[col],), (seed,),
                                             has_aux=True)  # fmt: skip
        return top, (unscaled + [unscale(top, one / s[-1])], scaled + [top])

    return chain


def _second(f: Callable, cols: Tuple[int, ...]) -> Chain:
    """The chain of a pure second derivative (``u__x__x``): one propagated tangent."""
    one = jnp.float32(1.0)

    def chain(x, s):
        s1, s2 = s
        # outer seed s2/s1 over inner seed s1, as two factors: s1**2 may underflow float32
        y, first, second = taylor.second_order(_along(f, x, cols[0]), x[cols[0]], s1, (s2 / s1, one / s1))
        return second, ([y, unscale(first, one / s1), unscale(second, one / s2)], [first, second])

    return chain


def _series(f: Callable, cols: Tuple[int, ...]) -> Chain:
    """The chain of a pure derivative of order >= 3 (``u__x__x__x``): Taylor mode, one
    propagated chain per order, each carrying its own scale."""
    one = jnp.float32(1.0)

    def chain(x, s):
        y, scaled = taylor.series(_along(f, x, cols[0]), x[cols[0]], one, len(cols), list(s))
        return scaled[-1], ([y] + [unscale(d, one / sk) for d, sk in zip(scaled, s)], list(scaled))

    return chain
