"""A damped Gauss-Newton step (Levenberg-Marquardt, the form energy natural gradient takes for a
least-squares loss) as an optax transformation, and the scaled Jacobian it needs
(docs/optax_recipes.md, "Second-order and natural-gradient steps").

For ``loss = sum(r**2)`` with residuals ``r(params)`` and their Jacobian ``J``, the step is
``delta = J^T (J J^T + lam I)^-1 r`` (the m x m dual form: m residuals, fewer than the
parameters), ``lam = damping * trace(J J^T) / m``, followed by a grid line search over step sizes
``2**-k`` on ``value_fn`` (as ENGD does). Under :func:`jaxamp.optimizer` the ``value_fn`` runs
under the state's scales (a trial point whose derivatives overflow is worth ``+inf``).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

import jaxamp


class GaussNewtonState(NamedTuple):
    step_size: jax.Array  # the last step's line-search step size (1.0 before the first)
    count: jax.Array  # steps applied


def gauss_newton(damping=1e-4, line_search_steps=12):
    """``update(grads, state, params, *, jacobian, residuals, value_fn)``: ``jacobian`` the tree of
    ``d residuals / d params`` (each leaf ``(m, *leaf.shape)``), ``residuals`` ``f32[m]``;
    ``grads`` (``J^T r``) is not used by the step, the wrapper checks it."""

    def init(params):
        return GaussNewtonState(jnp.float32(1.0), jnp.int32(0))

    def update(grads, state, params=None, *, jacobian, residuals, value_fn):
        flat, unravel = ravel_pytree(params)
        m = residuals.shape[0]
        J = jnp.concatenate([x.reshape(m, -1) for x in jax.tree_util.tree_leaves(jacobian)], axis=1)
        K = J @ J.T
        lam = damping * jnp.trace(K) / m
        delta = J.T @ jnp.linalg.solve(K + lam * jnp.eye(m, dtype=K.dtype), residuals)
        sizes = 2.0 ** -jnp.arange(line_search_steps, dtype=jnp.float32)
        values = jax.lax.map(lambda t: value_fn(unravel(flat - t * delta)), sizes)
        best = jnp.argmin(jnp.where(jnp.isnan(values), jnp.inf, values))
        t = sizes[best]
        return unravel(-t * delta), GaussNewtonState(t, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


def scaled_jacobian(residuals):
    """``jac(opt_state, params, *args) -> (J, r, grads, found)``: the Jacobian of
    ``residuals(params, *args)`` with respect to ``params`` under the state's derivative scales,
    its backward passes loss-scaled (the residuals times the state's loss scale inside
    ``jax.jacrev``, the Jacobian divided by it after), ``grads = J^T r`` (non-finite when ``J`` is,
    so the loss scale backs off), and the derivative flags of :func:`jaxamp.scaled`."""

    def jac(opt_state, params, *args):
        amp = opt_state.amp
        s = amp.loss_scale if amp.loss_rule is not None else jnp.float32(1.0)

        def both(p, *a):
            return jax.jacrev(lambda q: s * residuals(q, *a))(p), residuals(p, *a)

        (J, r), found = jaxamp.scaled(both, amp.amp)(amp.scales, params, *args)
        J = jax.tree_util.tree_map(lambda x: x / s, J)
        grads = jax.tree_util.tree_map(lambda x: jnp.tensordot(r, x, axes=1), J)
        return J, r, grads, found

    return jac


def gauss_newton_step(tx, residuals, loss):
    """The jitted Gauss-Newton step ``(params, opt_state, batch) -> (params, opt_state, sum r^2)``
    of ``tx`` (a :func:`jaxamp.optimizer` of :func:`gauss_newton`): the Jacobian and the gradient
    under the state's scales (:func:`scaled_jacobian`), the flags deciding the step."""
    jac = scaled_jacobian(residuals)

    @jax.jit
    def step(params, opt_state, b):
        J, r, grads, found = jac(opt_state, params, b)
        updates, opt_state = tx.update(grads, opt_state, params, flags=found, jacobian=J, residuals=r,
                                       value_fn=lambda p: loss(p, b))
        return optax.apply_updates(params, updates), opt_state, jnp.sum(r**2)

    return step
