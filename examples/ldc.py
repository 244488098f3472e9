"""Lid-driven cavity as in Modulus Sym's ``ldc`` example: ``python -m examples.ldc``.

Without ``--config`` it runs ``ldc_cpu`` (4x128, sized for a CPU); ``--config ldc_gpu`` is
Modulus' own size (6x512, batches 1000/1000/4000).

Box ``[-L/2, L/2]^2`` (Modulus: ``L = 0.1``), steady incompressible Navier-Stokes with
density 1 and viscosity ``nu``; the lid ``y = L/2`` moves at ``u = U`` (``v = 0``), its
constraint weighted ``1 - |x| / (L/2)`` (zero at the corners), no-slip elsewhere. The
interior residuals are weighted by the signed distance to the walls, and each constraint
contributes ``measure * mean(weight * residual^2)`` (Modulus sums ``area * lambda * r^2``).
The reference is the finite-difference solution of the same flow (lid ``u = U`` up to the
corners) from :mod:`examples.references.cavity`.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Dict, Mapping, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from examples.common.config import positive, positive_int
from examples.common.problem import Problem, mean_sq, uniform


@functools.lru_cache(maxsize=4)
def _reference(n: int, box: float, nu: float, lid_speed: float):
    from examples.references.cavity import solve_cavity

    h = box / 2
    return solve_cavity(n, length=box, nu=nu, u_lid=lid_speed, origin=(-h, -h))


class LDC(Problem):
    name = "ldc"
    default_config = "ldc_cpu"
    inputs = ("x", "y")
    outputs = ("u", "v", "p")
    derivatives = (
        "u__x", "u__y", "v__x", "v__y", "p__x", "p__y", "u__x__x", "u__y__y", "v__x__x", "v__y__y",
    )
    eval_fields = ("u", "v")
    checks = {
        "problem.box": positive(),
        "problem.lid_speed": positive(),
        "problem.nu": positive(),
        "batch.top_wall": positive_int(),
        "batch.no_slip": positive_int(),
        "batch.interior": positive_int(),
        "eval.reference_n": (lambda v: v >= 17, "an integer >= 17 (reference grid nodes per side)"),
    }

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__(cfg)
        p = cfg["problem"]
        self.box, self.h, self.nu, self.lid = p["box"], p["box"] / 2, p["nu"], p["lid_speed"]
        self.sdf, self.measure = p["sdf_weighting"], p["measure_weighting"]
        self.batch = cfg["batch"]

    def sample(self, key: jax.Array) -> Dict[str, Any]:
        h, b = self.h, self.batch
        k = jax.random.split(key, 5)
        top_x = uniform(k[0], b["top_wall"], -h, h)
        s = uniform(k[1], b["no_slip"], 0.0, 3 * self.box)  # arc length: left, bottom, right wall
        left, bottom = s < self.box, (s >= self.box) & (s < 2 * self.box)
        wall_x = jnp.where(left, -h, jnp.where(bottom, s - self.box - h, h))
        wall_y = jnp.where(left, s - h, jnp.where(bottom, -h, s - 2 * self.box - h))
        return {
            "top": {"x": top_x, "y": jnp.full_like(top_x, h)},
            "wall": {"x": wall_x, "y": wall_y},
            "interior": {"x": uniform(k[2], b["interior"], -h, h), "y": uniform(k[3], b["interior"], -h, h)},
        }

    def loss(self, derive, batch) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        h, nu = self.h, self.nu
        top, wall = derive(batch["top"], derivatives=False), derive(batch["wall"], derivatives=False)
        d = derive(batch["interior"])
        lid_w = 1.0 - jnp.abs(batch["top"]["x"]) / h
        xi, yi = batch["interior"]["x"], batch["interior"]["y"]
        sdf = jnp.minimum(h - jnp.abs(xi), h - jnp.abs(yi)) if self.sdf else 1.0
        continuity = d["u__x"] + d["v__y"]
        mom_x = d["u"] * d["u__x"] + d["v"] * d["u__y"] + d["p__x"] - nu * (d["u__x__x"] + d["u__y__y"])
        mom_y = d["u"] * d["v__x"] + d["v"] * d["v__y"] + d["p__y"] - nu * (d["v__x__x"] + d["v__y__y"])
        m_top, m_wall, m_in = (self.box, 3 * self.box, self.box**2) if self.measure else (1.0, 1.0, 1.0)
        terms = {
            "top_wall": m_top * (mean_sq(top["u"] - self.lid, lid_w) + mean_sq(top["v"])),
            "no_slip": m_wall * (mean_sq(wall["u"]) + mean_sq(wall["v"])),
            "continuity": m_in * mean_sq(continuity, sdf),
            "momentum_x": m_in * mean_sq(mom_x, sdf),
            "momentum_y": m_in * mean_sq(mom_y, sdf),
        }
        return sum(terms.values()), terms

    def eval_grid(self, n: int):
        ax = np.linspace(-self.h, self.h, n)
        xx, yy = np.meshgrid(ax, ax, indexing="ij")
        return np.stack([xx.ravel(), yy.ravel()], -1), (ax, ax)

    def reference(self, points: np.ndarray) -> Dict[str, np.ndarray]:
        sol = _reference(int(self.cfg["eval"]["reference_n"]), self.box, self.nu, self.lid)
        u, v = sol(points[:, 0], points[:, 1])
        return {"u": np.asarray(u), "v": np.asarray(v)}


if __name__ == "__main__":
    from examples.common.main import main

    sys.exit(main(LDC))
