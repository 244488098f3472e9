"""A derivative of a ``jaxamp.grad`` chain, whatever transformation takes it, is a longer chain in
the program (issue #56): planned with the point's other requests, not the derivative of a plan."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from jaxamp._src.derivatives import chain
from jaxamp._src.derivatives.chain_call import chain_p


def u(p, t, x):
    return jnp.tanh(p[0] * t + p[1] * x) * jnp.sin(p[2] * x)


P = jnp.array([0.7, -1.3, 0.9])


def _chains(closed):
    return [e.params["link"].argnums for e in closed.jaxpr.eqns if e.primitive is chain_p]


def test_jax_jvp_of_a_chain_binds_the_longer_chain():
    u_x = jaxamp.grad(u, 2)
    closed = jax.make_jaxpr(lambda t, x: jax.jvp(lambda s: u_x(P, t, s), (x,), (1.0,)))(0.3, 0.5)
    assert sorted(_chains(closed), key=len) == [(2,), (2, 2)]  # x is the body's third array argument
    got = jax.jvp(lambda s: u_x(P, 0.3, s), (0.5,), (1.0,))[1]
    want = jax.grad(jax.grad(u, 2), 2)(P, 0.3, 0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_jax_hessian_of_a_chain_is_chains_with_jaxs_values():
    """jax.hessian over (t, x) of u_t: third-order chains, the parameters' derivative untouched."""
    u_t = jaxamp.grad(u, 1)
    f = lambda tx: u_t(P, tx[0], tx[1])  # noqa: E731
    tx = jnp.array([0.3, 0.5])
    closed = jax.make_jaxpr(jax.hessian(f))(tx)
    assert max(len(a) for a in _chains(closed)) == 3
    np.testing.assert_allclose(jax.hessian(f)(tx), jax.hessian(lambda z: jax.grad(u, 1)(P, z[0], z[1]))(tx),
                               rtol=1e-5, atol=1e-6)
    # the parameters' gradient of the same chain (the training step's) is the plan's own
    want = jax.grad(lambda p: jax.grad(u, 1)(p, 0.3, 0.5))(P)
    np.testing.assert_allclose(jax.grad(lambda p: u_t(p, 0.3, 0.5))(P), want, rtol=1e-5)


def test_mixed_partials_in_either_order_are_one_path():
    a = chain.Chain(u, (2, 1), (None, None), None)
    b = chain.Chain(u, (1, 2), (None, None), None)
    assert chain.canonical(a) == chain.canonical(b) == b
    named = chain.Chain(u, (2, 1), ("x", "t"), "u")  # per-term names read in order: kept as written
    assert chain.canonical(named) == named


def test_a_grad_of_a_body_holding_chains_is_scaled_and_checked_by_its_order():
    """d/dt of (u_x + u_xx): the chains one and two steps longer; under jaxamp.scaled its keys are
    the orders of the derivatives taken (1..3)."""
    u_x = jaxamp.grad(u, 2)
    u_xx = jaxamp.grad(u_x, 2)
    d = jaxamp.grad(lambda p, t, x: u_x(p, t, x) + u_xx(p, t, x), 1)
    T, X = jnp.linspace(-1, 1, 5), jnp.linspace(0, 1, 5)
    fn = jax.vmap(d, (None, 0, 0))
    got, found = jaxamp.scaled(fn)({"1": 1.0, "2": 1.0, "3": 1.0}, P, T, X)
    want = jax.vmap(jax.grad(lambda p, t, x: jax.grad(u, 2)(p, t, x) + jax.grad(jax.grad(u, 2), 2)(p, t, x), 1),
                    (None, 0, 0))(P, T, X)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert sorted(found) == ["1", "2", "3", "nonfinite_values"] and not any(bool(v) for v in found.values())
