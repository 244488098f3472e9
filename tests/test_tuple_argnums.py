"""``jaxamp.grad(u, argnums=(1, 2))`` along scalar inputs takes the engine's fast path: the same
program as one grad per argnum, values equal to jax.grad's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers.jax_user import make_net

AMP = jaxamp.AmpConfig()


def flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


@pytest.fixture(scope="module")
def net():
    _, u_net, params = make_net(jaxamp.AmpConfig(dtype="float32"))  # float32 layers: values compare to JAX
    return u_net, params


def residuals(u_net, tuple_form):
    u_xx = jaxamp.grad(jaxamp.grad(u_net, 2), 2)

    def r(p, t, x):
        if tuple_form:
            u_t, u_x = jaxamp.grad(u_net, argnums=(1, 2), wrt=("t", "x"))(p, t, x)
        else:
            u_t, u_x = jaxamp.grad(u_net, 1, wrt="t")(p, t, x), jaxamp.grad(u_net, 2, wrt="x")(p, t, x)
        return u_t + u_net(p, t, x) * u_x - 0.01 * u_xx(p, t, x)

    return lambda p, t, x: jax.vmap(r, (None, 0, 0))(p, t, x)


def test_tuple_argnums_values_equal_jax_grad(net):
    u_net, params = net
    t, x = jnp.float32(0.3), jnp.float32(-0.2)
    got = jaxamp.grad(u_net, argnums=(1, 2))(params, t, x)
    want = jax.grad(u_net, argnums=(1, 2))(params, t, x)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)


def test_tuple_argnums_is_the_per_argnum_program(net):
    u_net, params = net
    t, x = jnp.linspace(0.0, 1.0, 16), jnp.linspace(-1.0, 1.0, 16)
    state = jaxamp.init(residuals(u_net, False), AMP, from_profile=False)(params, t, x)
    outs = {}
    for form in (False, True):
        fn = jaxamp.scaled(residuals(u_net, form))
        outs[form] = (fn(state, params, t, x), flops(fn, state, params, t, x))
    (v_sep, f_sep), c_sep = outs[False]
    (v_tup, f_tup), c_tup = outs[True]
    np.testing.assert_array_equal(v_tup, v_sep)
    assert sorted(f_tup) == sorted(f_sep) == ["1", "2", "nonfinite_values"]
    assert c_tup == c_sep  # XLA FLOPs: the same passes, not a reverse-mode fallback


def test_reverse_method_keeps_jax_grad_for_tuple_argnums(net):
    u_net, params = net
    got = jaxamp.grad(u_net, argnums=(1, 2), method="reverse")(params, 0.3, -0.2)
    want = jax.grad(u_net, argnums=(1, 2))(params, 0.3, -0.2)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)
