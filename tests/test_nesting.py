"""A derivative's order and name come from the traced program (jaxamp._src.core.nesting), not from calls
made while tracing: the same keys under jit (cached or not), remat, custom_jvp, scan and cond."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp

METHODS = ("auto", "reverse")


def u_net(p, x):
    return jnp.tanh(p * x) + 0.1 * p * x**3


def keys_of(loss, amp=None):
    return tuple(jaxamp.init(loss, amp or jaxamp.AmpConfig())(jnp.float32(2.0), jnp.float32(0.3)).scales)


@pytest.mark.parametrize("method", METHODS)
def test_jit_between_grads_keeps_the_order_on_every_call(method):
    u_x = jax.jit(jaxamp.grad(u_net, 1, method=method))
    u_xx = jaxamp.grad(u_x, 1, method=method)

    def loss(p, x):
        return u_xx(p, x) ** 2 + u_x(p, x) ** 2

    assert [keys_of(loss) for _ in range(3)] == [("1", "2")] * 3  # the jit's trace is cached after the first
    scales = {"1": jnp.float32(1.0), "2": jnp.float32(0.5)}
    value, found_inf = jaxamp.scaled(loss)(scales, 2.0, 0.3)
    assert sorted(found_inf) == ["1", "2", "nonfinite_values"]
    plain = jax.grad(jax.grad(u_net, 1), 1)(2.0, 0.3) ** 2 + jax.grad(u_net, 1)(2.0, 0.3) ** 2
    assert jnp.allclose(value, plain, rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_a_second_order_step_is_keyed_two_even_when_its_inner_grad_is_cached(method):
    """The second-order step's overflow sets flag '2' only: an injected inf in the scale-2 seed."""
    u_x = jax.jit(jaxamp.grad(u_net, 1, method=method))
    u_x(2.0, 0.3)  # warm the jit cache before jaxamp sees it
    u_xx = jaxamp.grad(u_x, 1, method=method)
    huge = {"1": jnp.float32(1.0), "2": jnp.float32(jnp.inf)}
    _, found_inf = jaxamp.scaled(u_xx)(huge, 2.0, 0.3)
    assert bool(found_inf["2"]) and not bool(found_inf["1"])


@pytest.mark.parametrize("wrap", ["jit", "checkpoint", "custom_jvp", "scan", "cond"])
def test_any_wrapper_between_grads_gives_orders_one_and_two(wrap):
    inner = jaxamp.grad(u_net, 1, method="reverse")
    if wrap == "jit":
        u_x = jax.jit(inner)
    elif wrap == "checkpoint":
        u_x = jax.checkpoint(inner)
    elif wrap == "custom_jvp":
        u_x = jax.custom_jvp(inner)
        u_x.defjvp(lambda primals, tangents: (inner(*primals), jax.jvp(inner, primals, tangents)[1]))
    elif wrap == "scan":
        def u_x(p, x):
            return jax.lax.scan(lambda c, _: (inner(p, c), None), x, None, length=1)[0]
    else:
        def u_x(p, x):
            return jax.lax.cond(x > 0, inner, lambda p, x: 2.0 * inner(p, x), p, x)
    u_xx = jaxamp.grad(u_x, 1, method="reverse")
    loss = lambda p, x: u_xx(p, x) + u_x(p, x)  # noqa: E731
    if wrap in ("jit", "checkpoint", "custom_jvp"):  # jaxamp.profile inlines these bodies
        assert keys_of(loss) == ("1", "2")
    scales = {"1": jnp.float32(1.0), "2": jnp.float32(jnp.inf)}  # an overflow of key 2 only
    _, found_inf = jaxamp.scaled(loss)(scales, 2.0, 0.3)
    assert sorted(found_inf) == ["1", "2", "nonfinite_values"]
    assert bool(found_inf["2"]) and not bool(found_inf["1"])


def test_names_come_from_the_program_under_jit():
    amp = jaxamp.AmpConfig(mode="per_term_scaler")
    u_x = jax.jit(jaxamp.grad(u_net, 1, of="u", wrt="x", method="reverse"))
    u_xx = jaxamp.grad(u_x, 1, wrt="x", method="reverse")  # its name: u__x, from the inner step
    u_x(2.0, 0.3)
    assert [keys_of(lambda p, x: u_xx(p, x) + u_x(p, x), amp) for _ in range(2)] == [("u", "u__x")] * 2


def test_order_counts_only_derivatives_the_value_depends_on():
    """A grad whose function calls another grad without using it is a first derivative."""
    u_x = jaxamp.grad(u_net, 1, method="reverse")

    def f(p, x):
        unused = u_x(p, x)
        del unused
        return u_net(p, x)

    assert keys_of(jaxamp.grad(f, 1, method="reverse")) == ("1",)


@pytest.mark.parametrize("method", METHODS)
def test_third_order_through_two_jits(method):
    u_x = jax.jit(jaxamp.grad(u_net, 1, method=method))
    u_xx = jax.jit(jaxamp.grad(u_x, 1, method=method))
    u_xxx = jaxamp.grad(u_xx, 1, method=method)
    for _ in range(2):
        assert keys_of(lambda p, x: u_xxx(p, x)) == ("1", "2", "3")
    scales = {"1": 0.5, "2": 0.25, "3": 0.125}
    value, _ = jaxamp.scaled(u_xxx)(scales, 2.0, 0.3)
    expected = jax.grad(jax.grad(jax.grad(u_net, 1), 1), 1)(2.0, 0.3)
    assert jnp.allclose(value, expected, rtol=1e-5)
