"""The user's function is traced once per jaxamp call (scaled, value_and_grad, init), with the
passes of the jaxamp.grad chains that differentiate the same arguments shared; the sharing is
planned from the jaxpr, so it holds under vmap, jit and a closure over the parameters."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp._src.core.interpreter import trace
from jaxamp._src.core.tracing import expand

SCALES = {"1": 2.0**-3, "2": 2.0**-5}


def u_net(p, t, x):
    return jnp.tanh(p["w"] * x + p["b"] * t) * jnp.exp(-t)


def counted(vmap: bool, apart: bool = False):
    """A Burgers-like loss counting its traces; ``apart``: each chain at its own copy of the
    point (nothing to share)."""
    calls = []
    u_t = jaxamp.grad(u_net, 1, of="u", wrt="t")
    u_x = jaxamp.grad(u_net, 2, of="u", wrt="x")
    u_xx = jaxamp.grad(u_x, 2, wrt="x")

    def residual(p, t, x):
        copy = (lambda v, k: v + jnp.float32(k) * 0.0) if apart else (lambda v, k: v)
        return (u_t(p, copy(t, 1), copy(x, 1)) + u_net(p, t, x) * u_x(p, copy(t, 2), copy(x, 2))
                - 0.01 * u_xx(p, t, x))

    def loss(p, t, x):
        calls.append(1)
        r = jax.vmap(residual, (None, 0, 0))(p, t, x) if vmap else residual(p, t, x)
        return jnp.mean(r**2)

    return loss, calls


PARAMS = {"w": jnp.float32(1.3), "b": jnp.float32(0.4)}
POINTS = (jnp.linspace(0.0, 1.0, 5), jnp.linspace(-1.0, 1.0, 5))


def expected(p, t, x):
    """The residual's loss by nested jax.grad (the reference)."""
    u_t = jax.grad(u_net, 1)
    u_x = jax.grad(u_net, 2)
    u_xx = jax.grad(u_x, 2)
    r = jax.vmap(lambda t, x: u_t(p, t, x) + u_net(p, t, x) * u_x(p, t, x) - 0.01 * u_xx(p, t, x))(t, x)
    return jnp.mean(r**2)


@pytest.mark.parametrize("vmap", [False, True])
def test_scaled_traces_the_loss_once_and_shares_the_chains(vmap):
    loss, calls = counted(vmap)
    args = POINTS if vmap else (POINTS[0][1], POINTS[1][1])
    value, found_inf = jaxamp.scaled(loss)(SCALES, PARAMS, *args)
    assert len(calls) == 1
    assert sorted(found_inf) == ["1", "2", "nonfinite_values"]
    ref = expected(PARAMS, *(POINTS if vmap else (POINTS[0][1:2], POINTS[1][1:2])))
    assert jnp.allclose(value, ref, rtol=1e-5, atol=1e-7)
    # one plan for the three chains at one point: fewer passes than three chains at copies of it
    closed = expand(trace(loss, (PARAMS, *args), {})[0])
    apart = expand(trace(counted(vmap, apart=True)[0], (PARAMS, *args), {})[0])
    assert "jaxamp_chain" not in str(closed.jaxpr)
    assert str(closed.jaxpr).count("tanh") < str(apart.jaxpr).count("tanh")


def test_value_and_grad_and_init_trace_the_loss_once():
    loss, calls = counted(True)
    amp = jaxamp.AmpConfig()
    state = jaxamp.init(loss, amp)(PARAMS, *POINTS)
    assert len(calls) == 1 and sorted(state.scales) == ["1", "2"]
    opt = jaxamp.optimizer(optax.sgd(1e-3), amp_state=state)
    opt_state = opt.init(PARAMS)
    del calls[:]
    value, grads, flags = jaxamp.value_and_grad(loss)(opt_state, PARAMS, *POINTS)
    assert len(calls) == 1
    ref_value, ref_grads = jax.value_and_grad(expected)(PARAMS, *POINTS)
    assert jnp.allclose(value, ref_value, rtol=1e-5)
    updates, _ = opt.update(grads, opt_state, PARAMS, flags=flags)
    for k in PARAMS:
        assert jnp.allclose(-1e3 * updates[k], ref_grads[k], rtol=1e-4, atol=1e-6)


def test_chains_under_a_jit_of_the_loss_and_a_closure_share_passes():
    """A chain closing over the parameters (a user's ``lambda x: u(p, x)``) inside a jitted
    function: still one trace of the loss, values equal to nested jax.grad."""
    calls = []

    @jax.jit
    def loss(p, x):
        calls.append(1)
        u = lambda x: jnp.sin(p["w"] * x) * p["b"]
        u_x = jaxamp.grad(u)
        u_xx = jaxamp.grad(u_x)
        r = jax.vmap(lambda x: u_xx(x) + u_x(x) * u(x))(x)
        return jnp.mean(r**2)

    value, found_inf = jaxamp.scaled(loss)(SCALES, PARAMS, POINTS[1])
    assert len(calls) == 1 and sorted(found_inf) == ["1", "2", "nonfinite_values"]
    u = lambda x: jnp.sin(PARAMS["w"] * x) * PARAMS["b"]
    ref = jnp.mean(jax.vmap(lambda x: jax.grad(jax.grad(u))(x) + jax.grad(u)(x) * u(x))(POINTS[1]) ** 2)
    assert jnp.allclose(value, ref, rtol=1e-5)
