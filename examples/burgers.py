"""Viscous Burgers 1D (Raissi et al.'s benchmark): ``python -m examples.burgers``.

``u_t + u u_x = nu u_xx`` on ``x in [-1, 1], t in [0, 1]``, ``u(x, 0) = -sin(pi x)``,
``u(+-1, t) = 0``, ``nu = 0.01 / pi`` by default. A shock forms at ``x = 0`` after
``t ~ 1/pi``, where ``|u_xx|`` reaches ~1.8e4. The reference is the exact Cole-Hopf solution
from :mod:`examples.references.burgers`.

``problem.domain_scale=a`` poses the same problem in other units: ``x in [-a, a]``,
``t in [0, a]`` and viscosity ``a * nu``, whose solution is ``u(x / a, t / a)``. The network's
input layer divides the coordinates by ``a`` (:meth:`Burgers.input_scale`, as Modulus scales
inputs), so it computes the same function as for ``a = 1`` and every derivative is
``a**-order`` times the unit problem's (``a = 0.02``: ``u_xx`` 2500 times larger; the
shock's ~1.8e4 becomes ~4.5e7, far above float16's 65504).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Optional, Tuple

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
        "problem.domain_scale": positive(),
        "batch.initial": positive_int(),
        "batch.boundary": positive_int(),
        "batch.interior": positive_int(),
    }

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__(cfg)
        self.nu, self.batch = cfg["problem"]["nu"], cfg["batch"]
        self.a = cfg["problem"]["domain_scale"]  # x in [-a, a], t in [0, a], viscosity a * nu

    def input_scale(self) -> Optional[Tuple[float, ...]]:
        """The network sees ``x / a, t / a`` (the unit problem's coordinates), as Modulus scales inputs."""
        return None if self.a == 1.0 else (1.0 / self.a, 1.0 / self.a)

    def sample(self, key: jax.Array) -> Dict[str, Any]:
        b, a = self.batch, self.a
        k = jax.random.split(key, 5)
        x0 = uniform(k[0], b["initial"], -a, a)
        tb = uniform(k[1], b["boundary"], 0.0, a)
        xb = jnp.where(jax.random.bernoulli(k[2], 0.5, (b["boundary"],)), a, -a)
        return {
            "initial": {"x": x0, "t": jnp.zeros_like(x0)},
            "boundary": {"x": xb, "t": tb},
            "interior": {"x": uniform(k[3], b["interior"], -a, a), "t": uniform(k[4], b["interior"], 0.0, a)},
        }

    def loss(self, derive, batch) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        ini, bnd = derive(batch["initial"], derivatives=False), derive(batch["boundary"], derivatives=False)
        d = derive(batch["interior"])
        terms = {
            "initial": mean_sq(ini["u"] + jnp.sin(jnp.pi * batch["initial"]["x"] / self.a)),
            "boundary": mean_sq(bnd["u"]),
            "burgers": mean_sq(d["u__t"] + d["u"] * d["u__x"] - self.a * self.nu * d["u__x__x"]),
        }
        return sum(terms.values()), terms

    def eval_grid(self, n: int):
        x, t = np.linspace(-self.a, self.a, n), np.linspace(0.0, self.a, n)
        xx, tt = np.meshgrid(x, t, indexing="ij")
        return np.stack([xx.ravel(), tt.ravel()], -1), (x, t)

    def reference(self, points: np.ndarray) -> Dict[str, np.ndarray]:
        from examples.references.burgers import burgers_solution

        return {"u": burgers_solution(points[:, 0] / self.a, points[:, 1] / self.a, nu=self.nu)}


if __name__ == "__main__":
    from examples.common.main import main

    sys.exit(main(Burgers))
