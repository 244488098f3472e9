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
(``scipy.sparse.linalg.spsolve``), with grid sequencing (the solution on the
grid with every other node, interpolated, is the initial guess; the coarsest
grid starts from rest). The solve is declared converged when the max-norm of
the (``h**2``-scaled) residual is below ``tol``; otherwise
:class:`CavityConvergenceError` is raised.

The pressure is recovered afterwards from the momentum equation, which gives
``grad p`` at every node; ``p`` is its least-squares potential on the grid
edges (a Neumann pressure Poisson problem that is compatible by
construction), normalised to zero trapezoidal mean over the box. With a lid
that does not vanish at the corners (``u_lid = 1``) vorticity and pressure are
singular at the two top corners, and a kinked lid (the Modulus profile
``1 - 20|x|``) makes them singular (log-like) at the kink; values within a few
cells of those points are not meaningful. Elsewhere the pressure is second
order accurate (momentum residual shrinks 4x per grid doubling).

Everything is solved in units of the box side ``L`` and the lid-speed scale
``U = max |u_lid|``; the returned fields are in the caller's (dimensional)
units: ``u, v`` in the lid's velocity units, ``p`` in velocity**2 (kinematic
pressure, density 1), ``psi`` in velocity*length, ``omega`` in 1/time.

Accuracy: second order in ``h``. At ``Re = 100`` on a 129 x 129 grid the
centre-line velocities agree with Ghia, Ghia & Shin (1982) to 8.4e-3 (max;
that is the error of Ghia's tabulated values, which are not grid converged),
and Richardson-extrapolated extrema match grid-converged literature values
(``u_min = -0.21404``, ``v_min = -0.25380``) to ~1e-4 (see
``tests/examples/test_references.py``).

Cost: ~0.4 s for n = 65, ~3 s for n = 129, ~20 s for n = 257 (one CPU
core, dominated by the sparse LU factorisations). Re = 400 and 1000 also
converge (via Re continuation) on 129 x 129, but only to ~1e-2 accuracy:
central differences want a cell Reynolds number ``Re / (n - 1)`` of order 1.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.interpolate import RectBivariateSpline, RegularGridInterpolator
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
      iterations: Newton iterations taken on the finest grid.

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
            if pts.size and not (
                np.all(np.isfinite(pts)) and pts.min() >= grid[0] - tol and pts.max() <= grid[-1] + tol
            ):
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
        # Vorticity transport  visc * laplace(omega) - conv * J(psi, omega) = 0, scaled so that
        # the larger coefficient is 1 (keeps residuals O(psi) for any Re, incl. Stokes limit).
        self.visc, self.conv = (1.0 / reynolds, 1.0) if reynolds >= 1.0 else (1.0, reynolds)
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
        s, e = slice(1, -1), self.n - 1
        zero = np.zeros(self.n - 2)
        return [
            ((s, 0), (s, 1), (s, 2), zero),  # bottom: psi_y = u = 0
            ((s, e), (s, e - 1), (s, e - 2), -self.lid[1:-1]),  # top: -psi_y = -u_lid
            ((0, s), (1, s), (2, s), zero),  # left: psi_x = -v = 0
            ((e, s), (e - 1, s), (e - 2, s), zero),  # right: -psi_x = v = 0
        ]

    def residual(self, z: np.ndarray) -> np.ndarray:
        psi, om = self.unpack(z)
        h = self.h
        inner, plus, minus = slice(1, -1), slice(2, None), slice(None, -2)
        c, e, w = (inner, inner), (plus, inner), (minus, inner)  # centre, east, west
        nn, ss = (inner, plus), (inner, minus)  # north, south
        r_psi = psi[e] + psi[w] + psi[nn] + psi[ss] - 4 * psi[c] + h * h * om[c]
        r_om = self.visc * (om[e] + om[w] + om[nn] + om[ss] - 4 * om[c]) - 0.25 * self.conv * (
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
        n, h = self.n, self.h
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
            add(r_om, oid[I + di, J + dj], self.visc)
        add(r_psi, pid[I, J], -4.0)
        add(r_psi, oid[I, J], h * h)
        add(r_om, oid[I, J], -4.0 * self.visc)
        dpsi_y = self.conv * (psi[I, J + 1] - psi[I, J - 1])
        dpsi_x = self.conv * (psi[I + 1, J] - psi[I - 1, J])
        dom_x = self.conv * (om[I + 1, J] - om[I - 1, J])
        dom_y = self.conv * (om[I, J + 1] - om[I, J - 1])
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


def _newton(
    system: _System, z: np.ndarray, tol: float, max_iter: int
) -> tuple[np.ndarray, float, int]:
    """Damped Newton from the initial guess ``z``; returns (z, max|residual|, iterations)."""
    res = system.residual(z)
    norm = float(np.abs(res).max())
    if norm <= tol:
        return z, norm, 0
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
        "increase max_iter or n (the cell Reynolds number Re / (n - 1) should be of order 1)"
    )


def _solve_nondim(
    n: int, reynolds: float, lid: np.ndarray, tol: float, max_iter: int, depth: int = 0
) -> tuple[_System, np.ndarray, float, int]:
    """Newton solve on the unit square with grid sequencing and Re continuation.

    Initial guess: for odd ``n >= 33`` whose coarse grid (every other node,
    ``(n + 1) / 2`` per side) still resolves the flow (cell Reynolds number
    ``Re / (n_coarse - 1) <= 5``), the coarse solution interpolated bilinearly;
    Newton then needs only 2-4 iterations instead of ~6-12 from rest. If
    Newton fails from that guess (high Re), the problem is first solved at
    ``Re / 2`` on the same grid and that solution is used instead.
    """
    system = _System(n, reynolds, lid)
    z0 = np.zeros(system.size)
    n_c = (n + 1) // 2
    if n >= 33 and n % 2 == 1 and reynolds / (n_c - 1) <= 5.0:
        try:
            coarse, zc, _, _ = _solve_nondim(n_c, reynolds, lid[::2], max(tol, 1e-8), max_iter)
        except CavityConvergenceError:
            pass  # keep starting from rest
        else:
            psi_c, om_c = coarse.unpack(zc)
            s_c, s_f = np.linspace(0, 1, n_c), np.linspace(0, 1, n)
            mesh = np.stack(np.meshgrid(s_f, s_f, indexing="ij"), axis=-1)
            psi_f = RegularGridInterpolator((s_c, s_c), psi_c)(mesh)
            om_f = RegularGridInterpolator((s_c, s_c), om_c)(mesh)
            z0 = np.concatenate([psi_f[1:-1, 1:-1].ravel(), om_f.ravel()])
    try:
        z, res, iters = _newton(system, z0, tol, max_iter)
    except CavityConvergenceError as err:
        if reynolds <= 50.0 or depth >= 8:
            raise
        try:
            _, z0, _, _ = _solve_nondim(n, reynolds / 2, lid, max(tol, 1e-8), max_iter, depth + 1)
            z, res, iters = _newton(system, z0, tol, max_iter)
        except CavityConvergenceError:
            raise err from None  # report the failure at the requested Re
    return system, z, res, iters


def _pressure(u: np.ndarray, v: np.ndarray, om: np.ndarray, reynolds: float) -> np.ndarray:
    """Non-dimensional pressure (zero trapezoidal mean) from the momentum equation.

    The momentum equation gives the pressure gradient at every node,
    ``grad p = G = -(u . grad) u + (1/Re) (-omega_y, omega_x)`` (using
    ``laplace(u) = curl(omega)`` for divergence-free flow), with second-order
    central differences inside and one-sided ones on the walls. ``p`` is the
    least-squares fit of its edge differences to ``G`` averaged onto the grid
    edges, i.e. ``D^T D p = D^T g``: a Neumann pressure Poisson equation whose
    compatibility holds by construction, so errors from the singular lid
    corners stay local instead of polluting the whole field.
    """
    n = u.shape[0]
    h = 1.0 / (n - 1)
    ux, uy = np.gradient(u, h, h, edge_order=2)
    vx, vy = np.gradient(v, h, h, edge_order=2)
    ox, oy = np.gradient(om, h, h, edge_order=2)
    gx = -(u * ux + v * uy) - oy / reynolds
    gy = -(u * vx + v * vy) + ox / reynolds

    idx = np.arange(n * n).reshape(n, n)
    # Edge-difference operator D: one row per edge, (p_b - p_a) / h.
    a_x, b_x = idx[:-1, :].ravel(), idx[1:, :].ravel()  # edges along x
    a_y, b_y = idx[:, :-1].ravel(), idx[:, 1:].ravel()  # edges along y
    ne = a_x.size + a_y.size
    rows = np.concatenate([np.arange(ne), np.arange(ne)])
    cols = np.concatenate([a_x, a_y, b_x, b_y])
    vals = np.concatenate([-np.ones(ne), np.ones(ne)]) / h
    d = sp.csr_matrix((vals, (rows, cols)), shape=(ne, n * n))
    g = np.concatenate([0.5 * (gx[:-1, :] + gx[1:, :]).ravel(), 0.5 * (gy[:, :-1] + gy[:, 1:]).ravel()])
    lap = sp.lil_matrix(d.T @ d)
    rhs = d.T @ g  # orthogonal to the constants (the null space) by construction
    lap[0, :] = 0.0  # pin p[0, 0] = 0; the replaced equation is redundant
    lap[0, 0] = 1.0
    rhs[0] = 0.0
    p = spsolve(lap.tocsc(), rhs)
    w1 = np.ones(n)
    w1[[0, -1]] = 0.5
    w = np.outer(w1, w1)
    return p.reshape(n, n) - (w * p.reshape(n, n)).sum() / w.sum()


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

    system, z, res, iters = _solve_nondim(n, reynolds, lid_nd, tol, max_iter)
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
    p = _pressure(u, v, om, reynolds) if compute_pressure else None

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
      n: nodes per side, ``n >= 8`` (129: ~3 s; 257: ~20 s on one core).
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
    sol = solve_cavity(
        int(n), length=2 * MODULUS_LDC_HALF_WIDTH, nu=MODULUS_LDC_NU, u_lid=modulus_ldc_lid,
        origin=(-MODULUS_LDC_HALF_WIDTH, -MODULUS_LDC_HALF_WIDTH),
    )
    if use_cache:
        sol.save(path)
    return sol
