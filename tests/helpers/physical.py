"""A physical-units PINN where plain float16 dies, for the optimizer recipes
(tests/test_recipes_physical.py, docs/optax_recipes.md).

1-D Poisson on a rod of ``L = 2 mm``: ``-u'' = (pi/L)^2 sin(pi x/L)`` on ``[0, L]``, ``u = 0`` at
both ends, so ``u = sin(pi x/L)``. Written as a JAX user writes it: a plain-JAX tanh MLP on ``x``
in metres whose first layer's weights start at the rod's scale (``N(0, 1/L^2)``), under
:func:`jaxamp.autocast` with the first layer in float16 too (``autocast_firstlayer=True``), and
``u''`` by the user's own ``jax.hessian``. ``u''`` is about ``(pi/L)^2 = 2.5e6`` at the solution:
past float16's 65504, so plain fp16 (``derivative_scaling=False``) overflows in the first
layer's transposed matmul and skips every step. The residual is made dimensionless (times ``L^2``).

``problem(amp, fp32_boundary=True)`` evaluates the boundary values (no derivative, two points)
with the float32 network: in float16 the network's output near ``u = 0`` is rounded to about
``5e-4`` absolute, which the boundary weight 100 turns into a gradient error of 27 % of the whole
gradient after 300 Adam steps (docs/optax_recipes.md, "Adam, then L-BFGS").

``batch["overflow"]`` (``bool[]``) injects a derivative overflow of key ``"2"`` (the order of
``u''``) on chosen steps through jaxamp's own check marks (tests/helpers/injected.py).
"""

import jax
import jax.numpy as jnp

import jaxamp

from tests.helpers.injected import inject

L = 2e-3  # metres
DERIV_SCALER = jaxamp.AmpConfig(autocast_firstlayer=True)
PLAIN_FP16 = jaxamp.AmpConfig(autocast_firstlayer=True, derivative_scaling=False)
FP32 = jaxamp.AmpConfig(enabled=False)
# For runs of a few steps: the loss scale starts at 2^10, where this problem's weight gradients fit
# float16, so that the steps are applied ones (at the default 2^16 the first 6 are the loss scaler's).
FEW_STEPS = jaxamp.AmpConfig(autocast_firstlayer=True, loss_scaler={"init_scale": 2.0**10})
BC_WEIGHT = 100.0


def init_params(seed, width=16, depth=2):
    """``[(W, b), ...]`` of a tanh MLP ``1 -> width (x depth) -> 1``; the first layer's weights
    ``N(0, 1/L^2)`` (the rod's scale), the others Glorot-normal."""
    keys = jax.random.split(jax.random.PRNGKey(seed), depth + 1)
    sizes = [1] + [width] * depth + [1]
    params = []
    for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:])):
        std = 1.0 / L if i == 0 else (2.0 / (m + n)) ** 0.5
        params.append((std * jax.random.normal(k, (m, n)), jnp.zeros(n)))
    return params


def mlp(params, x):
    """``u(x)`` for a scalar ``x`` in metres."""
    h = jnp.reshape(x, (1,))
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    return (h @ w + b)[0]


def exact(x):
    return jnp.sin(jnp.pi * x / L)


def problem(amp, fp32_boundary=False):
    """``(u, residuals, losses, loss)`` of the Poisson problem under ``amp``:
    ``u(params, x)``; ``residuals(params, batch) -> f32[n + 2]`` (the dimensionless PDE residual
    at each interior point over ``sqrt(n)``, then the weighted boundary values over ``sqrt(2)``,
    so that ``sum(residuals**2) == loss``); ``losses(params, batch) -> {"pde", "bc"}``;
    ``loss = pde + BC_WEIGHT * bc``; ``fp32_boundary``: the boundary values by the float32 network."""
    u = jaxamp.autocast(mlp, amp)
    u_boundary = mlp if fp32_boundary else u

    def pde_residual(params, x):
        u_xx = jax.hessian(u, argnums=1)(params, x)
        return L**2 * (u_xx + (jnp.pi / L) ** 2 * jnp.sin(jnp.pi * x / L))

    def terms(params, batch):
        inject(batch["overflow"], 2)
        r = jax.vmap(pde_residual, (None, 0))(params, batch["x"])
        ub = jax.vmap(u_boundary, (None, 0))(params, jnp.array([0.0, L]))
        return r, ub

    def residuals(params, batch):
        r, ub = terms(params, batch)
        return jnp.concatenate([r / jnp.sqrt(r.size), ub * jnp.sqrt(BC_WEIGHT / ub.size)])

    def losses(params, batch):
        r, ub = terms(params, batch)
        return {"pde": jnp.mean(r**2), "bc": jnp.mean(ub**2)}

    def loss(params, batch):
        parts = losses(params, batch)
        return parts["pde"] + BC_WEIGHT * parts["bc"]

    return u, residuals, losses, loss


def batch(n=32, overflow=False, shift=0.0):
    """``n`` collocation points inside the rod (a uniform grid, offset by ``shift`` of a cell)."""
    x = (jnp.arange(n) + 0.5 + shift) / n * L
    return {"x": x, "overflow": jnp.asarray(overflow)}


def relative_error(u, params, n=201):
    """Relative L2 error of ``u(params, .)`` against the exact solution on ``n`` points."""
    x = jnp.linspace(0.0, L, n)
    pred = jax.vmap(u, (None, 0))(params, x)
    return float(jnp.linalg.norm(pred - exact(x)) / jnp.linalg.norm(exact(x)))
