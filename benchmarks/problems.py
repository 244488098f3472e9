"""The PINN problems of the benchmark matrix (``python -m benchmarks matrix``).

Each problem is a per-point network ``x -> y``, the derivatives its residuals need, the
residuals, a boundary or initial-condition term, and a point sampler. The problems are
chosen for the *shape* of their derivative graph, not for a solution to reach:

- ``poisson1d``: ``u__x__x`` of one input (a pure second order, the smallest graph);
- ``cavity``: steady 2-D Navier-Stokes (lid-driven cavity): u, v, p of (x, y), first and
  pure second derivatives (10 derivatives, :mod:`benchmarks.ldc`'s residuals);
- ``unsteady_ns``: 2-D Navier-Stokes in (x, y, t): first order in t, x, y and pure second
  order in x, y for u and v, first order in x, y for p (12 derivatives);
- ``ks``: Kuramoto-Sivashinsky ``u_t + u u_x + u_xx + u_xxxx = 0`` in (x, t): a pure 4th
  order (Taylor mode) next to orders 1 and 2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import ldc

Values = Dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One PINN problem: names, residuals and points.

    ``residuals(d, x)`` maps the engine's values ``{name: f32[N]}`` and the interior points
    ``f32[N, n_inputs]`` to ``{residual name: f32[N]}``; ``sample(rng, n, n_boundary)``
    returns ``{"interior": [n, n_inputs], "boundary": [n_boundary, n_inputs],
    "target": [n_boundary, k]}``: the first ``k`` outputs must equal ``target`` there.
    """

    name: str
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    derivatives: Tuple[str, ...]
    residuals: Callable[[Values, jax.Array], Values]
    sample: Callable[[np.random.Generator, int, int], Dict[str, np.ndarray]]


def _poisson_residuals(d: Values, x: jax.Array) -> Values:
    return {"pde": d["u__x__x"] + math.pi**2 * jnp.sin(math.pi * x[:, 0])}


def _poisson_sample(rng: np.random.Generator, n: int, nb: int) -> Dict[str, np.ndarray]:
    xb = np.resize(np.array([0.0, 1.0]), nb)[:, None]
    return {"interior": rng.uniform(0, 1, (n, 1)), "boundary": xb, "target": np.zeros((nb, 1))}


def _cavity_residuals(d: Values, x: jax.Array) -> Values:
    return ldc.residuals(d)


def _cavity_sample(rng: np.random.Generator, n: int, nb: int) -> Dict[str, np.ndarray]:
    pts = ldc.make_points(ldc.LDCSize(n_interior=n, n_lid=max(1, nb // 2), n_noslip=max(1, nb - nb // 2)),
                          seed=int(rng.integers(1 << 30)))
    lid, wall = np.asarray(pts["lid"]), np.asarray(pts["noslip"])
    target = np.concatenate([np.tile([1.0, 0.0], (len(lid), 1)), np.zeros((len(wall), 2))])
    return {"interior": np.asarray(pts["interior"]), "boundary": np.concatenate([lid, wall]), "target": target}


NU = 0.01
UNSTEADY_NS_DERIVATIVES = (
    "u__t", "u__x", "u__y", "u__x__x", "u__y__y",
    "v__t", "v__x", "v__y", "v__x__x", "v__y__y",
    "p__x", "p__y",
)


def _unsteady_ns_residuals(d: Values, x: jax.Array) -> Values:
    u, v = d["u"], d["v"]
    return {
        "continuity": d["u__x"] + d["v__y"],
        "momentum_x": d["u__t"] + u * d["u__x"] + v * d["u__y"] + d["p__x"] - NU * (d["u__x__x"] + d["u__y__y"]),
        "momentum_y": d["v__t"] + u * d["v__x"] + v * d["v__y"] + d["p__y"] - NU * (d["v__x__x"] + d["v__y__y"]),
    }


def _unsteady_ns_sample(rng: np.random.Generator, n: int, nb: int) -> Dict[str, np.ndarray]:
    """Interior of [-1, 1]^2 x [0, 1]; the initial condition is a Taylor-Green vortex at t = 0."""
    interior = np.concatenate([rng.uniform(-1, 1, (n, 2)), rng.uniform(0, 1, (n, 1))], axis=1)
    xy = rng.uniform(-1, 1, (nb, 2))
    x, y = np.pi * xy[:, 0], np.pi * xy[:, 1]
    target = np.stack([-np.cos(x) * np.sin(y), np.sin(x) * np.cos(y)], axis=1)
    return {"interior": interior, "boundary": np.concatenate([xy, np.zeros((nb, 1))], axis=1), "target": target}


def _ks_residuals(d: Values, x: jax.Array) -> Values:
    return {"pde": d["u__t"] + d["u"] * d["u__x"] + d["u__x__x"] + d["u__x__x__x__x"]}


def _ks_sample(rng: np.random.Generator, n: int, nb: int) -> Dict[str, np.ndarray]:
    """Interior of [-1, 1] x [0, 1]; initial condition ``u(x, 0) = cos(pi x)``."""
    interior = np.stack([rng.uniform(-1, 1, n), rng.uniform(0, 1, n)], axis=1)
    xb = rng.uniform(-1, 1, nb)
    return {"interior": interior, "boundary": np.stack([xb, np.zeros(nb)], axis=1),
            "target": np.cos(np.pi * xb)[:, None]}


PROBLEMS: Dict[str, Problem] = {
    p.name: p
    for p in (
        Problem("poisson1d", ("x",), ("u",), ("u__x__x",), _poisson_residuals, _poisson_sample),
        Problem("cavity", ldc.INPUTS, ldc.OUTPUTS, ldc.DERIVATIVES, _cavity_residuals, _cavity_sample),
        Problem("unsteady_ns", ("x", "y", "t"), ("u", "v", "p"), UNSTEADY_NS_DERIVATIVES, _unsteady_ns_residuals,
                _unsteady_ns_sample),
        Problem("ks", ("x", "t"), ("u",), ("u__t", "u__x", "u__x__x", "u__x__x__x__x"), _ks_residuals, _ks_sample),
    )
}


def make_batch(problem: Problem, n: int, n_boundary: int, seed: int = 0) -> Dict[str, jax.Array]:
    """Deterministic float32 points for ``problem``: ``n`` interior, ``n_boundary`` boundary."""
    raw = problem.sample(np.random.default_rng(seed), n, n_boundary)
    return {k: jnp.asarray(v, jnp.float32) for k, v in raw.items()}
