"""AMP off is the user's own program: a port under AmpConfig(enabled=False) or dtype="float32"
trains bit for bit as the plain JAX program it was ported from (params and losses after 50
jitted steps), on a hand-written MLP and on a Flax network, with the default route (the nests of
jaxamp.grad computed by the entry point's AMP-off pass as JAX's jax.grad) and method="reverse"
(JAX's reverse mode with jaxamp's marks at scale 1, which XLA folds away)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

STEPS = 50


def hand_mlp():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    sizes = [(2, 16), (16, 16), (16, 1)]
    params = [{"w": jax.random.normal(k, s) / np.sqrt(s[0]), "b": jnp.zeros(s[1])} for k, s in zip(keys, sizes)]

    def apply(p, z):
        for layer in p[:-1]:
            z = jnp.tanh(z @ layer["w"] + layer["b"])
        return z @ p[-1]["w"] + p[-1]["b"]

    return apply, params


class Net(nn.Module):
    @nn.compact
    def __call__(self, z):
        for _ in range(2):
            z = jnp.tanh(nn.Dense(16)(z))
        return nn.Dense(1)(z)


def flax_mlp():
    model = Net()
    return model.apply, model.init(jax.random.PRNGKey(1), jnp.zeros(2))


NETWORKS = {"hand": hand_mlp, "flax": flax_mlp}


def program(apply, grad, autocast=lambda f: f):
    """A Burgers residual as a user writes it, with ``grad`` (jax.grad or jaxamp.grad)."""
    net = autocast(apply)

    def u(p, t, x):
        return net(p, jnp.stack([t, x]))[0]

    u_t, u_x = grad(u, argnums=1), grad(u, argnums=2)
    u_xx = grad(grad(u, argnums=2), argnums=2)

    def loss(p, batch):
        t, x = batch
        r = jax.vmap(lambda t, x: u_t(p, t, x) + u(p, t, x) * u_x(p, t, x) - 0.01 * u_xx(p, t, x))(t, x)
        ic = jax.vmap(lambda x: u(p, 0.0, x) + jnp.sin(jnp.pi * x))(x)
        return jnp.mean(r**2) + jnp.mean(ic**2)

    return loss


def batch():
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    return jax.random.uniform(k1, (64,)), jax.random.uniform(k2, (64,), minval=-1.0, maxval=1.0)


def run_plain(apply, params):
    loss, opt = program(apply, jax.grad), optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state, b):
        value, grads = jax.value_and_grad(loss)(params, b)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return loop(step, params, opt.init(params))


def run_port(apply, params, amp, method):
    def grad(f, argnums):
        return jaxamp.grad(f, argnums=argnums, method=method)

    loss = program(apply, grad, lambda f: jaxamp.autocast(f, amp))
    amp_state = jaxamp.init(loss, amp)(params, batch())
    opt = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state)

    @jax.jit
    def step(params, opt_state, b):
        value, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        updates, opt_state = opt.update(grads, opt_state, params, flags=flags)
        return optax.apply_updates(params, updates), opt_state, value

    return loop(step, params, opt.init(params))


def loop(step, params, opt_state):
    b, losses = batch(), []
    for _ in range(STEPS):
        params, opt_state, value = step(params, opt_state, b)
        losses.append(value)
    return params, np.asarray(losses)


OFF = {"off": jaxamp.AmpConfig(enabled=False), "fp32": jaxamp.AmpConfig(dtype="float32")}
# each network and each way of turning AMP off in the fast suite; every combination under -m slow
FAST = [("hand", "off", "auto")]
CASES = [pytest.param(*c, marks=() if c in FAST else pytest.mark.slow)
         for c in [(n, a, m) for n in sorted(NETWORKS) for a in OFF for m in ("auto", "reverse")]]


@pytest.mark.parametrize("network,amp,method", CASES)
def test_amp_off_port_is_bit_identical_to_the_original(network, amp, method):
    apply, params, amp = *NETWORKS[network](), OFF[amp]
    want_params, want_losses = run_plain(apply, params)
    got_params, got_losses = run_port(apply, params, amp, method)
    np.testing.assert_array_equal(got_losses, want_losses)
    for got, want in zip(jax.tree_util.tree_leaves(got_params), jax.tree_util.tree_leaves(want_params)):
        np.testing.assert_array_equal(got, want)


def test_one_jitted_derivative_serves_amp_off_and_amp_on():
    """The config is passed to the entry point, never ambient: a ``jax.jit`` of a jaxamp.grad
    traced once (its trace cached) is JAX's derivative under an AMP-off state and the scaled,
    checked one under AMP on (it was an error: the trace depended on the config active then)."""
    u_x = jax.jit(jaxamp.grad(lambda p, x: jnp.tanh(p * x), 1))
    loss = lambda p, x: u_x(p, x) ** 2  # noqa: E731
    want = jax.grad(lambda p, x: jnp.tanh(p * x), 1)(2.0, 0.3) ** 2
    off = jaxamp.init(loss, jaxamp.AmpConfig(enabled=False))(2.0, 0.3)
    value, found = jaxamp.scaled(loss)(off, 2.0, 0.3)
    assert found == {} and value == want
    on = jaxamp.init(loss, jaxamp.AmpConfig(), from_profile=False)(2.0, 0.3)
    assert sorted(on.scales) == ["1"]
    value, found = jaxamp.scaled(loss)(on, 2.0, 0.3)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    assert sorted(found) == ["1", "nonfinite_values"] and not any(bool(v) for v in found.values())
