"""Manufactured solution of the 2D Helmholtz PINN benchmark.

Problem on ``[-1, 1]^2`` (dimensionless)::

    laplace(u) + k^2 u = f(x, y),      u = 0 on the boundary,

with the exact solution ``u = sin(a1 pi x) sin(a2 pi y)``, ``a1 = 1``,
``a2 = 4``, and ``k = 1``. Since ``laplace(u) = -(a1^2 + a2^2) pi^2 u``, the
forcing is ``f = (k^2 - a1^2 pi^2 - a2^2 pi^2) u = (1 - 17 pi^2) u``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "HELMHOLTZ_K",
    "HELMHOLTZ_A1",
    "HELMHOLTZ_A2",
    "helmholtz_solution",
    "helmholtz_forcing",
    "helmholtz_boundary_value",
    "helmholtz_laplacian",
]

#: Wave number ``k``.
HELMHOLTZ_K: float = 1.0
#: Mode numbers of the exact solution in x and y.
HELMHOLTZ_A1: int = 1
HELMHOLTZ_A2: int = 4


def _xy(x: np.ndarray | float, y: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    xb, yb = np.broadcast_arrays(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
    return xb, yb


def helmholtz_solution(x: np.ndarray | float, y: np.ndarray | float) -> np.ndarray:
    """Exact ``u(x, y) = sin(pi x) sin(4 pi y)``.

    Args:
      x, y: coordinates (normally in ``[-1, 1]``), broadcastable arrays.

    Returns:
      ``u`` with their broadcast shape.
    """
    xb, yb = _xy(x, y)
    return np.sin(HELMHOLTZ_A1 * np.pi * xb) * np.sin(HELMHOLTZ_A2 * np.pi * yb)


def helmholtz_laplacian(x: np.ndarray | float, y: np.ndarray | float) -> np.ndarray:
    """Analytic ``laplace(u) = -(a1^2 + a2^2) pi^2 u``; shapes as :func:`helmholtz_solution`."""
    return -(HELMHOLTZ_A1**2 + HELMHOLTZ_A2**2) * np.pi**2 * helmholtz_solution(x, y)


def helmholtz_forcing(
    x: np.ndarray | float, y: np.ndarray | float, k: float = HELMHOLTZ_K
) -> np.ndarray:
    """Right-hand side ``f = laplace(u) + k^2 u = (k^2 - pi^2 - 16 pi^2) u``.

    Args:
      x, y: coordinates, broadcastable arrays.
      k: wave number (finite; default 1).

    Returns:
      ``f`` with the broadcast shape of ``x`` and ``y``.
    """
    if not np.isfinite(k):
        raise ValueError(f"k must be a finite number, got k={k!r}")
    return (k**2 - (HELMHOLTZ_A1**2 + HELMHOLTZ_A2**2) * np.pi**2) * helmholtz_solution(x, y)


def helmholtz_boundary_value(x: np.ndarray | float, y: np.ndarray | float) -> np.ndarray:
    """Dirichlet data on the boundary of ``[-1, 1]^2``: identically 0 (broadcast shape)."""
    xb, yb = _xy(x, y)
    return np.zeros(xb.shape)
