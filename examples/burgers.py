"""Viscous Burgers 1D (Raissi et al.'s benchmark): ``python -m examples.burgers``.

``u_t + u u_x = nu u_xx`` on ``x in [-1, 1], t in [0, 1]``, ``u(x, 0) = -sin(pi x)``,
``u(+-1, t) = 0``, ``nu = 0.01 / pi`` by default. A shock forms at ``x = 0`` after
``t ~ 1/pi``, where ``|u_xx|`` reaches ~1.8e4. The reference is the exact Cole-Hopf solution
from :mod:`examples.references.burgers`.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from examples.common.config import positive, positive_int
from examples.common.problem import Problem, mean_sq, uniform


class Burgers(Problem):
    name = "burgers"
    inputs = ("x", "t")
    outputs = ("u",)
    derivatives = ("u__t", "u__x", "u__x__x")
    eval_fields = ("u",)
    checks = {
        "problem.nu": positive(),
        "batch.initial": positive_int(),
        "batch.boundary": positive_int(),
        "batch.interior": positive_int(),
    }

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__(cfg)
        self.nu, self.batch = cfg["problem"]["nu"], cfg["batch"]

    def sample(self, key: jax.Array) -> Dict[str, Any]:
        b = self.batch
        k = jax.random.split(key, 5)
        x0 = uniform(k[0], b["initial"], -1.0, 1.0)
        tb = uniform(k[1], b["boundary"], 0.0, 1.0)
        xb = jnp.where(jax.random.bernoulli(k[2], 0.5, (b["boundary"],)), 1.0, -1.0)
        return {
            "initial": {"x": x0, "t": jnp.zeros_like(x0)},
            "boundary": {"x": xb, "t": tb},
            "interior": {"x": uniform(k[3], b["interior"], -1.0, 1.0), "t": uniform(k[4], b["interior"], 0.0, 1.0)},
        }

    def loss(self, derive, batch) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        ini, bnd = derive(batch["initial"], derivatives=False), derive(batch["boundary"], derivatives=False)
        d = derive(batch["interior"])
        terms = {
            "initial": mean_sq(ini["u"] + jnp.sin(jnp.pi * batch["initial"]["x"])),
            "boundary": mean_sq(bnd["u"]),
            "burgers": mean_sq(d["u__t"] + d["u"] * d["u__x"] - self.nu * d["u__x__x"]),
        }
        return sum(terms.values()), terms

    def eval_grid(self, n: int):
        x, t = np.linspace(-1.0, 1.0, n), np.linspace(0.0, 1.0, n)
        xx, tt = np.meshgrid(x, t, indexing="ij")
        return np.stack([xx.ravel(), tt.ravel()], -1), (x, t)

    def reference(self, points: np.ndarray) -> Dict[str, np.ndarray]:
        from examples.references.burgers import burgers_solution

        return {"u": burgers_solution(points[:, 0], points[:, 1], nu=self.nu)}


if __name__ == "__main__":
    from examples.common.main import main

    sys.exit(main(Burgers))
