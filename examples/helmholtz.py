"""Helmholtz 2D with a Fourier-feature network: ``python -m examples.helmholtz``.

``u_xx + u_yy + k^2 u = f`` on ``[-1, 1]^2`` with ``u = 0`` on the boundary and ``f``
chosen so that ``u = sin(a1 pi x) sin(a2 pi y)`` (default ``k = 1, a1 = 1, a2 = 4``):
``f = (k^2 - (a1 pi)^2 - (a2 pi)^2) u``. The network is Modulus' FourierNet (fixed
``("axis", 0..9)`` frequencies); its features have large input derivatives (up to
``2 pi * 9`` per feature), which is where the derivative scalers' recover mode matters.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from examples.common.config import positive, positive_int
from examples.common.problem import Problem, mean_sq, uniform


def exact(x, y, a1: float, a2: float, xp=np):
    """The manufactured solution ``sin(a1 pi x) sin(a2 pi y)``."""
    return xp.sin(a1 * xp.pi * x) * xp.sin(a2 * xp.pi * y)


class Helmholtz(Problem):
    name = "helmholtz"
    inputs = ("x", "y")
    outputs = ("u",)
    derivatives = ("u__x__x", "u__y__y")
    eval_fields = ("u",)
    checks = {
        "problem.k": positive(),
        "problem.a1": positive(),
        "problem.a2": positive(),
        "batch.boundary": positive_int(),
        "batch.interior": positive_int(),
    }

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__(cfg)
        p = cfg["problem"]
        self.k, self.a1, self.a2, self.batch = p["k"], p["a1"], p["a2"], cfg["batch"]

    def sample(self, key: jax.Array) -> Dict[str, Any]:
        b = self.batch
        k = jax.random.split(key, 4)
        s = uniform(k[0], b["boundary"], 0.0, 8.0)  # perimeter arc length
        side, r = jnp.floor(s).astype(jnp.int32) // 2, jnp.mod(s, 2.0) - 1.0
        bx = jnp.select([side == 0, side == 1, side == 2], [r, jnp.ones_like(r), -r], -jnp.ones_like(r))
        by = jnp.select([side == 0, side == 1, side == 2], [-jnp.ones_like(r), r, jnp.ones_like(r)], -r)
        return {
            "boundary": {"x": bx, "y": by},
            "interior": {"x": uniform(k[1], b["interior"], -1.0, 1.0), "y": uniform(k[2], b["interior"], -1.0, 1.0)},
        }

    def loss(self, derive, batch) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        bnd, d = derive(batch["boundary"], derivatives=False), derive(batch["interior"])
        x, y = batch["interior"]["x"], batch["interior"]["y"]
        f = (self.k**2 - (self.a1 * jnp.pi) ** 2 - (self.a2 * jnp.pi) ** 2) * exact(x, y, self.a1, self.a2, jnp)
        terms = {
            "boundary": mean_sq(bnd["u"]),
            "helmholtz": mean_sq(d["u__x__x"] + d["u__y__y"] + self.k**2 * d["u"] - f),
        }
        return sum(terms.values()), terms

    def eval_grid(self, n: int):
        ax = np.linspace(-1.0, 1.0, n)
        xx, yy = np.meshgrid(ax, ax, indexing="ij")
        return np.stack([xx.ravel(), yy.ravel()], -1), (ax, ax)

    def reference(self, points: np.ndarray) -> Dict[str, np.ndarray]:
        if (self.a1, self.a2) == (1.0, 4.0):  # the benchmark: the shared reference module
            from examples.references.helmholtz import helmholtz_solution

            return {"u": np.asarray(helmholtz_solution(points[:, 0], points[:, 1]))}
        return {"u": exact(points[:, 0], points[:, 1], self.a1, self.a2)}

if __name__ == "__main__":
    from examples.common.main import main

    sys.exit(main(Helmholtz))
