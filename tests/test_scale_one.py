"""At scale 1 every drop-in path is plain float16 (``derivative_scaling=False``).

For each path (nested ``jaxamp.grad`` by the engine's plan and by reverse mode, ``jacrev``,
``jacfwd``, ``hessian``, ``jvp``, ``laplacian``) and two networks (a Flax MLP on sin/cos
Fourier features through :func:`jaxamp.autocast`; jaxamp's own ``FullyConnected``), the loss
and every weight gradient of ``jax.value_and_grad(jaxamp.scaled(loss, amp))`` at scale 1
equal those of the same code under ``AmpConfig(derivative_scaling=False)``: the loss bit for
bit; the weight gradients bit for bit where the path inlines the network (the engine's nests,
``hessian``, ``laplacian``, and ``FullyConnected``), and to float16 rounding where JAX's own
transform differentiates the autocast network boundary (``method="reverse"``, ``jacrev``,
``jacfwd``, ``jvp``): there each derivative order is its own boundary equation, so a weight's
gradient is summed from them in float32 after each was rounded to float16, where plain float16
sums them in float16 first. (Powers of two other than 1 are no oracle for the weight gradients:
their float16 cotangents are subnormal in part. ``tests/test_boundary.py`` holds a 4th-order
input derivative to that oracle.)

Compiled with XLA's excess precision off (every float16 operation rounds to float16); with
XLA's default flags under ``-m slow``.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers.jax_user import make_net
from tests.helpers.taylor import STRICT_FP16

AMP, PLAIN = jaxamp.AmpConfig(), jaxamp.AmpConfig(derivative_scaling=False)
POINTS = jax.random.uniform(jax.random.PRNGKey(1), (128, 2), jnp.float32, -1.0, 1.0)


class Fourier(nn.Module):
    @nn.compact
    def __call__(self, t, x):
        z = jnp.stack([t, x])
        h = jnp.concatenate([jnp.sin(jnp.pi * z), jnp.cos(2.0 * z)])
        for _ in range(3):
            h = jnp.tanh(nn.Dense(32)(h))
        return nn.Dense(1)(h)[0]


@functools.cache
def networks(amp):
    apply = jaxamp.autocast(Fourier().apply, amp)  # each case's config: the same placement (float16)
    fourier = (lambda p, t, x: apply(p, t, x), Fourier().init(jax.random.PRNGKey(0), 0.1, 0.2))
    _, u_net, params = make_net(AMP, layer_size=32, nr_layers=3)
    return {"fourier": fourier, "fully_connected": (u_net, params)}


def residual(path, u):
    """``r(p, t, x)`` of one path: Burgers for the nests, a Laplacian or its kin for the others."""
    uz = lambda p, z: u(p, z[0], z[1])  # noqa: E731
    if path in ("auto", "reverse"):
        u_t, u_x = jaxamp.grad(u, 1, method=path), jaxamp.grad(u, 2, method=path)
        u_xx = jaxamp.grad(u_x, 2, method=path)
        return lambda p, t, x: u_t(p, t, x) + u(p, t, x) * u_x(p, t, x) - 0.01 * u_xx(p, t, x)
    if path == "jvp":
        return lambda p, t, x: jaxamp.jvp(lambda s: u(p, s, x), (t,), (jnp.float32(1.0),))[1] - u(p, t, x)
    z = lambda t, x: jnp.stack([t, x])  # noqa: E731
    if path == "laplacian":
        return lambda p, t, x: jaxamp.laplacian(uz, 1)(p, z(t, x)) - u(p, t, x)
    if path == "hessian":
        return lambda p, t, x: jnp.trace(jaxamp.hessian(uz, 1)(p, z(t, x)))
    jac = {"jacrev": jaxamp.jacrev, "jacfwd": jaxamp.jacfwd}[path]
    return lambda p, t, x: jnp.sum(jac(lambda p, z: jnp.stack([uz(p, z), uz(p, z) ** 2]), 1)(p, z(t, x)))


def value_and_grads(net, path, amp, scales, options):
    u, params = networks(amp)[net]
    r = residual(path, u)
    loss = jaxamp.scaled(lambda p: jnp.mean(jax.vmap(r, (None, 0, 0))(p, POINTS[:, 0], POINTS[:, 1]) ** 2), amp)
    (value, found), grads = jax.jit(jax.value_and_grad(lambda p: loss(scales, p), has_aux=True),
                                    compiler_options=options)(params)
    return value, grads, found


PATHS = ("auto", "reverse", "jacrev", "jacfwd", "hessian", "jvp", "laplacian")


# Paths on which JAX's own transform meets the Fourier network's autocast boundary.
THROUGH_BOUNDARY = ("reverse", "jacrev", "jacfwd", "jvp")


def assert_one_program(net, path, options):
    value, grads, found = value_and_grads(net, path, AMP, {"1": 1.0, "2": 1.0}, options)
    plain_value, plain_grads, plain_found = value_and_grads(net, path, PLAIN, {}, options)
    assert plain_found == {} and not any(bool(v) for v in found.values()) and sorted(found)
    np.testing.assert_array_equal(value, plain_value)
    leaves, plain_leaves = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(plain_grads)
    assert len(leaves) == len(plain_leaves)
    exact = True
    for a, b in zip(leaves, plain_leaves):
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=f"{net} {path}")
        else:  # float16 rounding of a sum, relative to the gradient's size
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * float(np.max(np.abs(b))), err_msg=f"{net} {path}")


# The fast suite's budget: on one network, the default nest, hessian (jacfwd of jacrev), jvp
# and laplacian (hessian with -m slow); every path on both networks with -m slow.
FAST = ("auto", "jvp", "laplacian")
CASES = [(net, p) if net == "fully_connected" and p in FAST else pytest.param(net, p, marks=pytest.mark.slow)
         for net in ("fully_connected", "fourier") for p in PATHS]


@pytest.mark.parametrize("net,path", CASES)
def test_scale_1_is_plain_float16(net, path):
    assert_one_program(net, path, STRICT_FP16)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("net", ["fourier", "fully_connected"])
def test_scale_1_is_plain_float16_with_default_xla_flags(net, path):
    assert_one_program(net, path, None)
