"""Reference ("ground truth") solutions for the PINN example problems.

Pure numpy/scipy; no JAX. Three problems:

* :mod:`.cavity` -- steady lid-driven cavity (finite differences,
  streamfunction-vorticity, Newton): :func:`solve_cavity` for any square box,
  viscosity and lid profile (validated against Ghia, Ghia & Shin 1982 at
  Re = 100), and :func:`modulus_ldc_reference` for the NVIDIA Modulus LDC
  example (cached on disk).
* :mod:`.burgers` -- exact viscous Burgers solution via Cole-Hopf and
  Gauss-Hermite quadrature (:func:`burgers_solution`, analytic derivatives in
  :func:`burgers_derivatives`, :func:`burgers_max_uxx`).
* :mod:`.helmholtz` -- manufactured Helmholtz solution ``sin(pi x) sin(4 pi y)``.
"""

from .burgers import (
    BURGERS_NU,
    burgers_derivatives,
    burgers_initial_condition,
    burgers_max_uxx,
    burgers_solution,
)
from .cavity import (
    MODULUS_LDC_HALF_WIDTH,
    MODULUS_LDC_NU,
    CavityConvergenceError,
    CavitySolution,
    modulus_ldc_lid,
    modulus_ldc_reference,
    solve_cavity,
)
from .helmholtz import (
    HELMHOLTZ_A1,
    HELMHOLTZ_A2,
    HELMHOLTZ_K,
    helmholtz_boundary_value,
    helmholtz_forcing,
    helmholtz_laplacian,
    helmholtz_solution,
)

__all__ = [
    "BURGERS_NU",
    "burgers_derivatives",
    "burgers_initial_condition",
    "burgers_max_uxx",
    "burgers_solution",
    "MODULUS_LDC_HALF_WIDTH",
    "MODULUS_LDC_NU",
    "CavityConvergenceError",
    "CavitySolution",
    "modulus_ldc_lid",
    "modulus_ldc_reference",
    "solve_cavity",
    "HELMHOLTZ_A1",
    "HELMHOLTZ_A2",
    "HELMHOLTZ_K",
    "helmholtz_boundary_value",
    "helmholtz_forcing",
    "helmholtz_laplacian",
    "helmholtz_solution",
]
