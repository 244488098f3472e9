"""Steady 2D lid-driven cavity: a finite-difference reference solver.

Problem
-------
Incompressible Navier-Stokes, density 1, in the square box
``[x0, x0 + L] x [y0, y0 + L]``::

    (u . grad) u + grad p = nu * laplace(u),      div u = 0,

with no-slip walls except the top wall (``y = y0 + L``), which moves in
``+x`` with a prescribed profile ``u = u_lid(x)``, ``v = 0``.

Method
------
Streamfunction-vorticity form on a uniform ``n x n`` node grid
(``h = 1 / (n - 1)`` after scaling the box to the unit square)::

    laplace(psi) = -omega,
    psi_y * omega_x - psi_x * omega_y = laplace(omega) / Re,

with ``u = psi_y``, ``v = -psi_x``, ``omega = v_x - u_y``. All derivatives are
second-order central differences; ``psi = 0`` on the walls and the wall
vorticity comes from Jensen's second-order formula (one-sided Taylor expansion
of ``psi`` normal to the wall, which also imposes the tangential wall
velocity). The discrete nonlinear system (unknowns: interior ``psi``, all
``omega``) is solved by a damped Newton method with an exact sparse Jacobian
(``scipy.sparse.linalg.spsolve``), started from rest. The solve is declared
converged when the max-norm of the (``h**2``-scaled) residual is below ``tol``;
otherwise :class:`CavityConvergenceError` is raised.

The pressure is recovered afterwards from the pressure Poisson equation
``laplace(p) = 2 (psi_xx psi_yy - psi_xy**2)`` with Neumann data taken from the
momentum equation on the walls (``dp/dn = nu * d(omega)/dt`` there, ``t`` the
tangent); it is normalised to zero (trapezoidal) mean over the box. With a
discontinuous lid (``u_lid = 1`` up to the corners) the pressure is singular at
the two top corners, so values in the corner cells are not meaningful there.

Everything is solved in units of the box side ``L`` and the lid-speed scale
``U = max |u_lid|``; the returned fields are in the caller's (dimensional)
units: ``u, v`` in the lid's velocity units, ``p`` in velocity**2 (kinematic
pressure, density 1), ``psi`` in velocity*length, ``omega`` in 1/time.

Accuracy: second order in ``h``. At ``Re = 100`` the centre-line velocities
agree with Ghia, Ghia & Shin (1982) to about 1e-3 on a 129 x 129 grid (see
``tests/examples/test_references.py``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.interpolate import RectBivariateSpline
from scipy.sparse.linalg import spsolve

__all__ = [
    "CavityConvergenceError",
    "CavitySolution",
    "solve_cavity",
    "modulus_ldc_reference",
    "MODULUS_LDC_HALF_WIDTH",
    "MODULUS_LDC_NU",
    "modulus_ldc_lid",
]

#: Half side of the NVIDIA Modulus LDC box ``[-0.05, 0.05]**2`` (length units).
MODULUS_LDC_HALF_WIDTH = 0.05
#: Kinematic viscosity of the Modulus LDC problem (Re = 1 * 0.1 / 0.01 = 10).
MODULUS_LDC_NU = 0.01
#: Bump this when the solver changes in a way that alters cached results.
_CACHE_VERSION = 1

LidProfile = float | Callable[[np.ndarray], np.ndarray]


class CavityConvergenceError(RuntimeError):
    """The Newton iteration did not reach the requested residual."""


def modulus_ldc_lid(x: np.ndarray) -> np.ndarray:
    """Lid profile of the Modulus LDC example: ``u = 1 - 20 |x|`` on ``[-0.05, 0.05]``.

    Args:
      x: lid abscissae, any shape, in box coordinates (length units).

    Returns:
      Lid velocity, same shape as ``x``: 1 at ``x = 0``, 0 at the corners.
    """
    return 1.0 - np.abs(np.asarray(x, dtype=float)) / MODULUS_LDC_HALF_WIDTH


@dataclass(eq=False)
class CavitySolution:
    """Steady cavity flow on a uniform node grid (``ij`` indexing).

    Attributes:
      x: node abscissae, shape ``(n,)``, from ``x0`` to ``x0 + L``.
      y: node ordinates, shape ``(n,)``, from ``y0`` to ``y0 + L``.
      u, v: velocity components, shape ``(n, n)``, ``u[i, j] = u(x[i], y[j])``;
        wall nodes hold the boundary values (top row, corners included, holds
        ``u_lid``).
      p: kinematic pressure (density 1), shape ``(n, n)``, zero mean, or
        ``None`` when it was not computed.
      psi: streamfunction, shape ``(n, n)`` (0 on the walls).
      omega: vorticity ``v_x - u_y``, shape ``(n, n)``; corner values are only
        the average of their neighbours.
      nu: kinematic viscosity used.
      reynolds: ``U L / nu`` with ``U = max |u_lid|``.
      residual: final max-norm of the scaled discrete residual.
      iterations: Newton iterations taken.

    Calling the object, ``sol(x, y)``, interpolates ``(u, v)`` at arbitrary
    points of the box (bicubic spline through the nodes); :meth:`pressure`
    does the same for ``p``.
    """

    x: np.ndarray
    y: np.ndarray
    u: np.ndarray
    v: np.ndarray
    p: np.ndarray | None
    psi: np.ndarray
    omega: np.ndarray
    nu: float
    reynolds: float
    residual: float
    iterations: int
    _splines: dict[str, RectBivariateSpline] = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        """Nodes per side."""
        return int(self.x.size)

    def _spline(self, name: str) -> RectBivariateSpline:
        if name not in self._splines:
            values = getattr(self, name)
            if values is None:
                raise ValueError(f"field {name!r} was not computed (compute_pressure=False)")
            self._splines[name] = RectBivariateSpline(self.x, self.y, values, kx=3, ky=3, s=0)
        return self._splines[name]

    def _points(self, x: np.ndarray | float, y: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        xb, yb = np.broadcast_arrays(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
        tol = 1e-9 * (self.x[-1] - self.x[0])
        for name, pts, grid in (("x", xb, self.x), ("y", yb, self.y)):
            if pts.size and (pts.min() < grid[0] - tol or pts.max() > grid[-1] + tol):
                raise ValueError(
                    f"{name} must lie in [{grid[0]:g}, {grid[-1]:g}] (the cavity), "
                    f"got values in [{pts.min():g}, {pts.max():g}]"
                )
        return np.clip(xb, self.x[0], self.x[-1]), np.clip(yb, self.y[0], self.y[-1])

    def __call__(self, x: np.ndarray | float, y: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """Interpolate the velocity.

        Args:
          x, y: coordinates in the box (length units), broadcastable arrays.

        Returns:
          ``(u, v)``, each of the broadcast shape of ``x`` and ``y``.

        Raises:
          ValueError: if a point lies outside the box.
        """
        xb, yb = self._points(x, y)
        return (self._spline("u").ev(xb, yb), self._spline("v").ev(xb, yb))

    def pressure(self, x: np.ndarray | float, y: np.ndarray | float) -> np.ndarray:
        """Interpolate the (zero-mean, kinematic) pressure at ``(x, y)``; shapes as in ``__call__``."""
        xb, yb = self._points(x, y)
        return self._spline("p").ev(xb, yb)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the grid fields to an ``.npz`` file (atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {k: getattr(self, k) for k in ("x", "y", "u", "v", "psi", "omega")}
        if self.p is not None:
            arrays["p"] = self.p
        meta = np.array([self.nu, self.reynolds, self.residual, self.iterations], dtype=float)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, meta=meta, **arrays)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CavitySolution:
        """Read a solution written by :meth:`save`."""
        with np.load(path) as data:
            nu, reynolds, residual, iterations = data["meta"]
            return cls(
                x=data["x"], y=data["y"], u=data["u"], v=data["v"],
                p=data["p"] if "p" in data else None,
                psi=data["psi"], omega=data["omega"], nu=float(nu),
                reynolds=float(reynolds), residual=float(residual), iterations=int(iterations),
            )


# ---------------------------------------------------------------------------
# Discrete system on the unit square (non-dimensional)
# ---------------------------------------------------------------------------


class _System:
    """Residual and Jacobian of the non-dimensional streamfunction-vorticity equations.

    Unknown vector ``z = [psi[1:-1, 1:-1].ravel(), omega.ravel()]`` (``ij``
    indexing, i along x). Equations are scaled by ``h**2`` (interior) or
    ``2 h**2`` (walls) so that all residual entries are O(psi).
    """

    def __init__(self, n: int, reynolds: float, lid: np.ndarray) -> None:
        self.n, self.re, self.lid = n, reynolds, lid
        self.h = 1.0 / (n - 1)
        m = n - 2
        self.n_psi = m * m
        self.size = self.n_psi + n * n
        psi_id = -np.ones((n, n), dtype=np.int64)
        psi_id[1:-1, 1:-1] = np.arange(self.n_psi).reshape(m, m)
        self.psi_id = psi_id
        self.om_id = self.n_psi + np.arange(n * n).reshape(n, n)

    def unpack(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.n
        psi = np.zeros((n, n))
        psi[1:-1, 1:-1] = z[: self.n_psi].reshape(n - 2, n - 2)
        return psi, z[self.n_psi :].reshape(n, n)

    def _walls(self) -> list[tuple[tuple, tuple, tuple, np.ndarray]]:
        """(wall nodes, first and second nodes inward, inward normal derivative of psi)."""
        s, e, mid = slice(1, -1), self.n - 1, self.n - 2
        zero = np.zeros(self.n - 2)
        return [
            ((s, 0), (s, 1), (s, 2), zero),  # bottom: psi_y = u = 0
            ((s, e), (s, e - 1), (s, e - 2), -self.lid[1:-1]),  # top: -psi_y = -u_lid
            ((0, s), (1, s), (2, s), zero),  # left: psi_x = -v = 0
            ((e, s), (mid, s), (mid - 1, s), zero),  # right
        ]

    def residual(self, z: np.ndarray) -> np.ndarray:
        psi, om = self.unpack(z)
        h, re = self.h, self.re
        c, e, w, nn, ss = (slice(1, -1), slice(1, -1)), (slice(2, None), slice(1, -1)), \
            (slice(None, -2), slice(1, -1)), (slice(1, -1), slice(2, None)), (slice(1, -1), slice(None, -2))
        r_psi = psi[e] + psi[w] + psi[nn] + psi[ss] - 4 * psi[c] + h * h * om[c]
        r_om = (om[e] + om[w] + om[nn] + om[ss] - 4 * om[c]) / re - 0.25 * (
            (psi[nn] - psi[ss]) * (om[e] - om[w]) - (psi[e] - psi[w]) * (om[nn] - om[ss])
        )
        r_wall = np.zeros((self.n, self.n))
        for node, first, second, dpsi_dn in self._walls():
            # Jensen: omega_w = (7 psi_w - 8 psi_1 + psi_2) / (2 h^2) + 3 dpsi/dn / h, psi_w = 0
            r_wall[node] = 2 * h * h * om[node] + 8 * psi[first] - psi[second] - 6 * h * dpsi_dn
        e_ = self.n - 1
        for corner, a, b in (((0, 0), (1, 0), (0, 1)), ((e_, 0), (e_ - 1, 0), (e_, 1)),
                             ((0, e_), (1, e_), (0, e_ - 1)), ((e_, e_), (e_ - 1, e_), (e_, e_ - 1))):
            r_wall[corner] = om[corner] - 0.5 * (om[a] + om[b])
        r_wall[1:-1, 1:-1] = r_om
        return np.concatenate([r_psi.ravel(), r_wall.ravel()])

    def jacobian(self, z: np.ndarray) -> sp.csc_matrix:
        psi, om = self.unpack(z)
        n, h, re = self.n, self.h, self.re
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []

        def add(r: np.ndarray, cidx: np.ndarray, v: np.ndarray | float) -> None:
            v = np.broadcast_to(np.asarray(v, dtype=float), r.shape)
            keep = cidx >= 0  # psi on the walls is fixed (not an unknown)
            rows.append(r[keep])
            cols.append(cidx[keep])
            vals.append(v[keep])

        I, J = np.meshgrid(np.arange(1, n - 1), np.arange(1, n - 1), indexing="ij")
        pid, oid = self.psi_id, self.om_id
        r_psi, r_om = pid[I, J], oid[I, J]  # equation rows of the interior nodes
        for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            add(r_psi, pid[I + di, J + dj], 1.0)
            add(r_om, oid[I + di, J + dj], 1.0 / re)
        add(r_psi, pid[I, J], -4.0)
        add(r_psi, oid[I, J], h * h)
        add(r_om, oid[I, J], -4.0 / re)
        dpsi_y = psi[I, J + 1] - psi[I, J - 1]
        dpsi_x = psi[I + 1, J] - psi[I - 1, J]
        dom_x = om[I + 1, J] - om[I - 1, J]
        dom_y = om[I, J + 1] - om[I, J - 1]
        add(r_om, pid[I, J + 1], -0.25 * dom_x)
        add(r_om, pid[I, J - 1], 0.25 * dom_x)
        add(r_om, pid[I + 1, J], 0.25 * dom_y)
        add(r_om, pid[I - 1, J], -0.25 * dom_y)
        add(r_om, oid[I + 1, J], -0.25 * dpsi_y)
        add(r_om, oid[I - 1, J], 0.25 * dpsi_y)
        add(r_om, oid[I, J + 1], 0.25 * dpsi_x)
        add(r_om, oid[I, J - 1], -0.25 * dpsi_x)

        k = np.arange(1, n - 1)
        e = n - 1
        walls = [((k, 0 * k), (k, 0 * k + 1), (k, 0 * k + 2)),
                 ((k, 0 * k + e), (k, 0 * k + e - 1), (k, 0 * k + e - 2)),
                 ((0 * k, k), (0 * k + 1, k), (0 * k + 2, k)),
                 ((0 * k + e, k), (0 * k + e - 1, k), (0 * k + e - 2, k))]
        for node, first, second in walls:
            r = oid[node]
            add(r, oid[node], 2 * h * h)
            add(r, pid[first], 8.0)
            add(r, pid[second], -1.0)
        for corner, a, b in (((0, 0), (1, 0), (0, 1)), ((e, 0), (e - 1, 0), (e, 1)),
                             ((0, e), (1, e), (0, e - 1)), ((e, e), (e - 1, e), (e, e - 1))):
            r = np.array([oid[corner]])
            add(r, np.array([oid[corner]]), 1.0)
            add(r, np.array([oid[a]]), -0.5)
            add(r, np.array([oid[b]]), -0.5)

        return sp.csc_matrix(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
            shape=(self.size, self.size),
        )


def _newton(system: _System, tol: float, max_iter: int) -> tuple[np.ndarray, float, int]:
    """Damped Newton from rest; returns (z, max|residual|, iterations)."""
    z = np.zeros(system.size)
    res = system.residual(z)
    norm = float(np.abs(res).max())
    for it in range(1, max_iter + 1):
        step = spsolve(system.jacobian(z), -res)
        if not np.all(np.isfinite(step)):
            raise CavityConvergenceError(f"Newton step {it} is not finite (singular Jacobian?)")
        alpha = 1.0
        while True:  # backtracking on the max-norm of the residual
            z_new = z + alpha * step
            res_new = system.residual(z_new)
            norm_new = float(np.abs(res_new).max())
            if norm_new < norm or alpha < 1e-3:
                break
            alpha *= 0.5
        z, res, norm = z_new, res_new, norm_new
        if norm <= tol:
            return z, norm, it
    raise CavityConvergenceError(
        f"cavity Newton solve did not converge: max|residual| = {norm:.3e} > tol = {tol:.1e} "
        f"after max_iter = {max_iter} iterations (n = {system.n}, Re = {system.re:g}); "
        "increase max_iter or n (cell Reynolds number Re/(n-1) should stay below ~2-5)"
    )


def _pressure(psi: np.ndarray, om: np.ndarray, lid: np.ndarray, reynolds: float) -> np.ndarray:
    """Non-dimensional pressure from the pressure Poisson equation (Neumann, zero mean)."""
    n = psi.shape[0]
    h = 1.0 / (n - 1)
    # Source 2 (u_x v_y - u_y v_x) = 2 (psi_xx psi_yy - psi_xy^2); on the walls only the lid's
    # tangential stretching survives: u_x = u_lid', v_y = -u_x  ->  -2 u_lid'^2.
    src = np.zeros((n, n))
    pxx = (psi[2:, 1:-1] - 2 * psi[1:-1, 1:-1] + psi[:-2, 1:-1]) / h**2
    pyy = (psi[1:-1, 2:] - 2 * psi[1:-1, 1:-1] + psi[1:-1, :-2]) / h**2
    pxy = (psi[2:, 2:] - psi[2:, :-2] - psi[:-2, 2:] + psi[:-2, :-2]) / (4 * h**2)
    src[1:-1, 1:-1] = 2 * (pxx * pyy - pxy**2)
    src[:, -1] = -2 * np.gradient(lid, h) ** 2
    # Neumann data from the momentum equation on the walls (velocity and its tangential
    # derivatives vanish there, v = 0 on the lid): p_x = -omega_y / Re, p_y = omega_x / Re.
    gy_bottom = np.gradient(om[:, 0], h) / reynolds
    gy_top = np.gradient(om[:, -1], h) / reynolds
    gx_left = -np.gradient(om[0, :], h) / reynolds
    gx_right = -np.gradient(om[-1, :], h) / reynolds

    idx = np.arange(n * n).reshape(n, n)
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    rhs = src.copy() * h * h
    I, J = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    rows.append(idx.ravel())
    cols.append(idx.ravel())
    vals.append(np.full(n * n, -4.0))
    for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        ti, tj = I + di, J + dj
        ghost_i = np.where(ti < 0, 1, np.where(ti > n - 1, n - 2, ti))  # mirror node of a ghost
        ghost_j = np.where(tj < 0, 1, np.where(tj > n - 1, n - 2, tj))
        rows.append(idx.ravel())
        cols.append(idx[ghost_i, ghost_j].ravel())
        vals.append(np.ones(n * n))
    # Ghost values: p_ghost = p_mirror + 2h * (outward normal derivative).
    rhs[0, :] += 2 * h * gx_left  # outward derivative on the left is -p_x
    rhs[-1, :] -= 2 * h * gx_right
    rhs[:, 0] += 2 * h * gy_bottom
    rhs[:, -1] -= 2 * h * gy_top
    a = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(n * n, n * n))
    # The Neumann operator has the constants as null space and the trapezoidal weights as
    # left null vector; border it: A p + lam * 1 = b, w.p = 0 (lam absorbs incompatibility).
    w1 = np.ones(n)
    w1[[0, -1]] = 0.5
    w = np.outer(w1, w1).ravel()
    big = sp.bmat([[a, sp.csr_matrix(np.ones((n * n, 1)))], [sp.csr_matrix(w[None, :]), None]],
                  format="csc")
    sol = spsolve(big, np.concatenate([rhs.ravel(), [0.0]]))
    return sol[:-1].reshape(n, n)


def _lid_values(u_lid: LidProfile, x: np.ndarray) -> np.ndarray:
    if callable(u_lid):
        vals = np.asarray(u_lid(x.copy()), dtype=float)
        if vals.shape != x.shape:
            vals = np.broadcast_to(vals, x.shape).astype(float)
    else:
        vals = np.full(x.shape, float(u_lid))
    if not np.all(np.isfinite(vals)):
        raise ValueError("u_lid must be finite on the lid, got non-finite values")
    return vals


def solve_cavity(
    n: int = 129,
    *,
    length: float = 1.0,
    nu: float = 0.01,
    u_lid: LidProfile = 1.0,
    origin: tuple[float, float] = (0.0, 0.0),
    tol: float = 1e-10,
    max_iter: int = 30,
    compute_pressure: bool = True,
) -> CavitySolution:
    """Solve the steady lid-driven cavity on an ``n x n`` uniform node grid.

    Args:
      n: nodes per side (walls included), ``n >= 8``. Use ``n - 1`` a multiple
        of 128 (e.g. 129, 257) to hit Ghia et al.'s grid points exactly.
      length: box side ``L`` (> 0), length units.
      nu: kinematic viscosity (> 0), length**2 / time.
      u_lid: lid velocity, either a constant or a function of the lid abscissa
        ``x`` (array in box coordinates, length units) returning an array of the
        same shape. The lid moves in +x at ``y = y0 + L``; ``v = 0`` there.
      origin: ``(x0, y0)``, the lower-left corner of the box.
      tol: convergence threshold on the max-norm of the ``h**2``-scaled
        non-dimensional residual (> 0).
      max_iter: maximum number of Newton iterations (>= 1).
      compute_pressure: also solve the pressure Poisson equation.

    Returns:
      A :class:`CavitySolution` (grid fields in dimensional units, callable
      interpolant of ``(u, v)``).

    Raises:
      ValueError: for invalid arguments.
      CavityConvergenceError: if Newton does not reach ``tol``.
    """
    if not isinstance(n, (int, np.integer)) or n < 8:
        raise ValueError(f"n must be an integer >= 8 (nodes per side), got n={n!r}")
    if not (np.isfinite(length) and length > 0):
        raise ValueError(f"length must be a finite number > 0, got length={length!r}")
    if not (np.isfinite(nu) and nu > 0):
        raise ValueError(f"nu must be a finite number > 0, got nu={nu!r}")
    if not (np.isfinite(tol) and tol > 0):
        raise ValueError(f"tol must be a finite number > 0, got tol={tol!r}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got max_iter={max_iter!r}")
    n = int(n)
    x0, y0 = (float(origin[0]), float(origin[1]))
    s = np.linspace(0.0, 1.0, n)
    x, y = x0 + length * s, y0 + length * s
    lid = _lid_values(u_lid, x)
    speed = float(np.abs(lid).max())
    if speed == 0.0:  # fluid at rest
        zeros = np.zeros((n, n))
        return CavitySolution(x, y, zeros, zeros.copy(), zeros.copy() if compute_pressure else None,
                              zeros.copy(), zeros.copy(), float(nu), 0.0, 0.0, 0)
    reynolds = speed * length / nu
    lid_nd = lid / speed

    system = _System(n, reynolds, lid_nd)
    z, res, iters = _newton(system, tol, max_iter)
    psi, om = system.unpack(z)

    h = 1.0 / (n - 1)
    u = np.zeros((n, n))
    v = np.zeros((n, n))
    u[:, 1:-1] = (psi[:, 2:] - psi[:, :-2]) / (2 * h)
    v[1:-1, :] = -(psi[2:, :] - psi[:-2, :]) / (2 * h)
    u[0, :] = u[-1, :] = 0.0  # side walls
    u[:, 0] = 0.0
    u[:, -1] = lid_nd  # lid, corners included
    v[:, 0] = v[:, -1] = 0.0
    p = _pressure(psi, om, lid_nd, reynolds) if compute_pressure else None

    return CavitySolution(
        x=x, y=y, u=speed * u, v=speed * v,
        p=None if p is None else speed**2 * p,
        psi=speed * length * psi, omega=(speed / length) * om,
        nu=float(nu), reynolds=reynolds, residual=res, iterations=iters,
    )


def _default_cache_dir() -> Path:
    env = os.environ.get("JAXAMP_CACHE_DIR")
    if env:
        return Path(env) / "references"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "jaxamp" / "references"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "jaxamp-references"


def modulus_ldc_reference(
    n: int = 129,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
) -> CavitySolution:
    """Reference flow of the NVIDIA Modulus lid-driven-cavity example.

    Box ``x, y in [-0.05, 0.05]``, lid at ``y = 0.05`` with ``u = 1 - 20 |x|``,
    ``v = 0``, no-slip elsewhere, ``nu = 0.01``, density 1 (``Re = 10``).

    Args:
      n: nodes per side, ``n >= 8`` (129 takes a couple of seconds; 257 ~ 10 s).
      cache_dir: directory for the ``.npz`` cache; default
        ``$JAXAMP_CACHE_DIR/references``, else ``$XDG_CACHE_HOME`` (or
        ``~/.cache``)``/jaxamp/references``, else a temp directory.
      use_cache: read/write the cache (``False`` always solves).

    Returns:
      A :class:`CavitySolution` in box coordinates: ``sol(x, y) -> (u, v)``,
      ``sol.pressure(x, y)`` (zero-mean kinematic pressure).
    """
    if not isinstance(n, (int, np.integer)) or n < 8:
        raise ValueError(f"n must be an integer >= 8 (nodes per side), got n={n!r}")
    key = f"v{_CACHE_VERSION}-n{int(n)}-L0.1-nu{MODULUS_LDC_NU}-lid1m20absx"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    path = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    path = path / f"modulus_ldc_n{int(n)}_{digest}.npz"
    if use_cache and path.exists():
        try:
            return CavitySolution.load(path)
        except (OSError, KeyError, ValueError):
            pass  # corrupt cache: recompute
    t0 = time.perf_counter()
    sol = solve_cavity(
        int(n), length=2 * MODULUS_LDC_HALF_WIDTH, nu=MODULUS_LDC_NU, u_lid=modulus_ldc_lid,
        origin=(-MODULUS_LDC_HALF_WIDTH, -MODULUS_LDC_HALF_WIDTH),
    )
    del t0
    if use_cache:
        sol.save(path)
    return sol
