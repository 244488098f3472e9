"""Exact solution of the viscous Burgers benchmark used by PINN papers.

Problem (Raissi, Perdikaris & Karniadakis 2019; Basdevant et al. 1986)::

    u_t + u u_x = nu u_xx,   x in [-1, 1],  t in [0, 1],  nu = 0.01 / pi,
    u(x, 0) = -sin(pi x),    u(-1, t) = u(1, t) = 0.

Method
------
The Cole-Hopf transform ``u = -2 nu phi_x / phi`` turns the problem into the
heat equation; with the 2-periodic, even initial datum
``phi(y, 0) = f(y) = exp(-cos(pi y) / (2 pi nu))`` this gives::

    u(x, t) = - int sin(pi (x - eta)) f(x - eta) exp(-eta^2 / (4 nu t)) d eta
              / int f(x - eta) exp(-eta^2 / (4 nu t)) d eta.

Substituting ``eta = sqrt(4 nu t) z`` both integrals have the weight
``exp(-z^2)`` and are evaluated with Gauss-Hermite quadrature. ``f`` reaches
``exp(1 / (2 pi nu)) = exp(50)``, so the sums are formed in log space: the
largest exponent is factored out of numerator and denominator (log-sum-exp),
which keeps everything in ``[0, 1]``.

Derivatives ``u_x, u_xx`` are obtained the same way by differentiating under
the integral (``f' / f = sin(pi y) / (2 nu)``), so they are as accurate as
``u`` itself; :func:`burgers_max_uxx` uses them.

Accuracy: with the default 128 Hermite nodes the quadrature is converged to
~1e-14 everywhere in ``[-1, 1] x [0, 1]`` (checked against 300 nodes in the
tests), shock included. Once the shock has formed (t > 1/pi) the integrand
peaks far from ``z = 0``, so small node counts are *not* accurate near
``x = 0`` at late times (40 nodes: error 3e-5 at t = 1; 60 nodes: 1e-9).
"""

from __future__ import annotations

import functools

import numpy as np
from scipy.optimize import minimize
from scipy.special import roots_hermite

__all__ = [
    "BURGERS_NU",
    "burgers_initial_condition",
    "burgers_solution",
    "burgers_derivatives",
    "burgers_max_uxx",
]

#: Viscosity of the benchmark, ``0.01 / pi``.
BURGERS_NU: float = 0.01 / np.pi

_DEFAULT_NODES = 128


@functools.lru_cache(maxsize=8)
def _hermite(n_quad: int) -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Hermite nodes and log-weights (weights underflow for large n, their logs do not)."""
    z, w = roots_hermite(n_quad)  # scipy: stable for large n, unlike numpy's hermgauss
    keep = w > 0.0
    return z[keep], np.log(w[keep])


def _check_inputs(
    x: np.ndarray | float, t: np.ndarray | float, nu: float, n_quad: int
) -> tuple[np.ndarray, np.ndarray]:
    if not (np.isfinite(nu) and nu > 0):
        raise ValueError(f"nu must be a finite number > 0, got nu={nu!r}")
    if not isinstance(n_quad, (int, np.integer)) or not 20 <= n_quad <= 5000:
        raise ValueError(
            f"n_quad must be an integer in [20, 5000] (Gauss-Hermite nodes), got n_quad={n_quad!r}"
        )
    xb, tb = np.broadcast_arrays(np.asarray(x, dtype=float), np.asarray(t, dtype=float))
    if xb.size:
        if not np.all(np.isfinite(xb)) or xb.min() < -1.0 or xb.max() > 1.0:
            raise ValueError(f"x must lie in [-1, 1], got values in [{np.nanmin(xb):g}, {np.nanmax(xb):g}]")
        if not np.all(np.isfinite(tb)) or tb.min() < 0.0 or tb.max() > 1.0:
            raise ValueError(f"t must lie in [0, 1], got values in [{np.nanmin(tb):g}, {np.nanmax(tb):g}]")
    return xb, tb


def burgers_initial_condition(x: np.ndarray | float) -> np.ndarray:
    """``u(x, 0) = -sin(pi x)``; ``x`` any shape, returns the same shape."""
    return -np.sin(np.pi * np.asarray(x, dtype=float))


def _moments(
    x: np.ndarray, t: np.ndarray, nu: float, n_quad: int, order: int
) -> list[np.ndarray]:
    """Ratios ``[u, u_x, u_xx][:order + 1]`` for flat arrays x, t with t > 0."""
    z, logw = _hermite(int(n_quad))
    scale = np.sqrt(4.0 * nu * t)[:, None]
    y = x[:, None] - scale * z[None, :]  # (points, nodes): the argument x - eta
    s, c = np.sin(np.pi * y), np.cos(np.pi * y)
    a = 1.0 / (2.0 * nu)  # f'/f = a s
    expo = logw[None, :] - c / (2.0 * np.pi * nu)  # log(w_k f(y_k))
    wk = np.exp(expo - expo.max(axis=1, keepdims=True))  # factored out, in [0, 1]
    den = wk.sum(axis=1)
    # N = sum w s f, D = sum w f and their x-derivatives, all divided by D:
    n0 = (wk * s).sum(axis=1) / den
    out = [-n0]
    if order >= 1:
        d1 = (wk * a * s).sum(axis=1) / den
        n1 = (wk * (np.pi * c + a * s * s)).sum(axis=1) / den
        out.append(-(n1 - n0 * d1))
    if order >= 2:
        d2 = (wk * (a * a * s * s + np.pi * a * c)).sum(axis=1) / den
        n2 = (wk * (-np.pi**2 * s + 3 * np.pi * a * s * c + a * a * s**3)).sum(axis=1) / den
        out.append(-(n2 - 2 * n1 * d1 - n0 * d2 + 2 * n0 * d1 * d1))
    return out


def _evaluate(
    x: np.ndarray | float, t: np.ndarray | float, nu: float, n_quad: int, order: int,
    chunk: int = 4096,
) -> list[np.ndarray]:
    xb, tb = _check_inputs(x, t, nu, n_quad)
    xf, tf = xb.ravel(), tb.ravel()
    # t = 0: the initial condition and its exact derivatives.
    px = np.pi * xf
    res = [-np.sin(px), -np.pi * np.cos(px), np.pi**2 * np.sin(px)][: order + 1]
    pos = np.flatnonzero(tf > 0.0)
    for start in range(0, pos.size, chunk):  # bounded memory: chunk x n_quad temporaries
        sel = pos[start : start + chunk]
        for r, m in zip(res, _moments(xf[sel], tf[sel], nu, n_quad, order)):
            r[sel] = m
    return [r.reshape(xb.shape) for r in res]


def burgers_solution(
    x: np.ndarray | float,
    t: np.ndarray | float,
    *,
    nu: float = BURGERS_NU,
    n_quad: int = _DEFAULT_NODES,
) -> np.ndarray:
    """Exact ``u(x, t)`` of the Burgers benchmark.

    Args:
      x: positions in ``[-1, 1]``, any shape.
      t: times in ``[0, 1]``, broadcastable against ``x``.
      nu: viscosity (default ``0.01 / pi``).
      n_quad: Gauss-Hermite nodes (20..5000; default 128, see module docstring).

    Returns:
      ``u`` with the broadcast shape of ``x`` and ``t`` (float64). ``t = 0``
      returns ``-sin(pi x)`` exactly.

    Raises:
      ValueError: if ``x`` is outside ``[-1, 1]``, ``t`` outside ``[0, 1]``,
        or ``nu`` / ``n_quad`` are invalid.
    """
    return _evaluate(x, t, nu, n_quad, order=0)[0]


def burgers_derivatives(
    x: np.ndarray | float,
    t: np.ndarray | float,
    *,
    nu: float = BURGERS_NU,
    n_quad: int = _DEFAULT_NODES,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(u, u_x, u_xx)`` at ``(x, t)``; arguments and shapes as :func:`burgers_solution`.

    ``u_t`` follows from the PDE: ``u_t = nu u_xx - u u_x``.
    """
    u, ux, uxx = _evaluate(x, t, nu, n_quad, order=2)
    return u, ux, uxx


def burgers_max_uxx(
    nx: int = 401,
    nt: int = 26,
    *,
    nu: float = BURGERS_NU,
    n_quad: int = _DEFAULT_NODES,
    refine: bool = True,
) -> tuple[float, float, float]:
    """Largest ``|u_xx|`` over ``[-1, 1] x [0, 1]``.

    ``u_xx`` is computed analytically (see :func:`burgers_derivatives`). The
    maximum is first located on a uniform ``nx x nt`` grid and then, with
    ``refine=True``, polished by a bounded Nelder-Mead search within two grid
    cells of the grid maximum, so the result does not depend on the grid
    resolving the peak (which sits ~``1.3 nu`` from the shock at ``x = 0``).

    Args:
      nx: grid points in x (>= 3). nt: grid points in t (>= 2).
      nu, n_quad: as in :func:`burgers_solution`.
      refine: polish the grid maximum (default) or return it as is.

    Returns:
      ``(max |u_xx|, x at the max, t at the max)``. For the benchmark
      (``nu = 0.01/pi``) this is about ``1.8e4`` at ``|x| ~ 0.004``,
      ``t ~ 0.51`` (the time the shock is steepest).
    """
    if not isinstance(nx, (int, np.integer)) or nx < 3:
        raise ValueError(f"nx must be an integer >= 3, got nx={nx!r}")
    if not isinstance(nt, (int, np.integer)) or nt < 2:
        raise ValueError(f"nt must be an integer >= 2, got nt={nt!r}")
    x = np.linspace(-1.0, 1.0, int(nx))
    t = np.linspace(0.0, 1.0, int(nt))
    best, bx, bt = -1.0, 0.0, 0.0
    for tk in t:  # one time level at a time keeps memory at nx * n_quad
        uxx = np.abs(burgers_derivatives(x, tk, nu=nu, n_quad=n_quad)[2])
        i = int(np.argmax(uxx))
        if uxx[i] > best:
            best, bx, bt = float(uxx[i]), float(x[i]), float(tk)
    if not refine:
        return best, bx, bt

    def neg_abs_uxx(p: np.ndarray) -> float:
        xx, tt = float(np.clip(p[0], -1.0, 1.0)), float(np.clip(p[1], 0.0, 1.0))
        return -float(np.abs(burgers_derivatives(xx, tt, nu=nu, n_quad=n_quad)[2]))

    dx, dt = x[1] - x[0], t[1] - t[0]
    bounds = [(max(-1.0, bx - 2 * dx), min(1.0, bx + 2 * dx)), (max(0.0, bt - 2 * dt), min(1.0, bt + 2 * dt))]
    opt = minimize(neg_abs_uxx, np.array([bx, bt]), method="Nelder-Mead", bounds=bounds,
                   options={"xatol": 1e-9, "fatol": 1e-9 * best, "maxiter": 2000})
    if -opt.fun > best:
        best, bx, bt = float(-opt.fun), float(opt.x[0]), float(opt.x[1])
    return best, bx, bt
