"""Nested jaxamp.grad along scalar inputs runs as one engine plan (jaxamp._src.derivatives.chain).

Oracles: JAX's nested jax.grad (float32 values to rounding), the binary-scaling identity (scales
2^k change no bit of a float32 program's values), method="reverse" on the same float16 network
(to float16 rounding), and injected infinities for the flags.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp


def u(p, t, x):
    return jnp.tanh(p[0] * t + p[1] * x) * jnp.sin(p[2] * x) + p[3] * x**3


P = jnp.array([0.3, 1.7, 2.1, 0.2])
T, X = jnp.linspace(0.0, 1.0, 16), jnp.linspace(-1.0, 1.0, 16)


def nest(f, argnum, k, jax_grad=False, **kw):
    for _ in range(k):
        f = jax.grad(f, argnum) if jax_grad else jaxamp.grad(f, argnum, **kw)
    return f


def residual(g):
    def r(p, t, x):
        return (g(u, 1, 1)(p, t, x) + u(p, t, x) * g(u, 2, 1)(p, t, x) - 0.1 * g(u, 2, 2)(p, t, x)
                + g(g(u, 1, 1), 2, 1)(p, t, x))

    return jax.vmap(r, (None, 0, 0))


def test_values_equal_nested_jax_grad_in_float32():
    for k in (1, 2, 3, 4):
        ours = jax.jit(jax.vmap(nest(u, 2, k), (None, 0, 0)))(P, T, X)
        theirs = jax.jit(jax.vmap(nest(u, 2, k, jax_grad=True), (None, 0, 0)))(P, T, X)
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(theirs))))
    ours = jaxamp.scaled(residual(lambda f, a, k: nest(f, a, k)))({"1": 0.5, "2": 0.25}, P, T, X)[0]
    theirs = residual(lambda f, a, k: nest(f, a, k, jax_grad=True))(P, T, X)
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-5)


def test_binary_scales_change_no_bit_of_a_float32_program():
    run = jax.jit(jaxamp.scaled(residual(lambda f, a, k: nest(f, a, k))))
    at_one, found = run({"1": 1.0, "2": 1.0}, P, T, X)
    scaled, _ = run({"1": 2.0**-5, "2": 2.0**-11}, P, T, X)
    np.testing.assert_array_equal(at_one, scaled)
    assert sorted(found) == ["1", "2", "nonfinite_values"] and not any(map(bool, found.values()))


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_weight_gradients_equal_jax_and_reverse_gradients_match_on_float16():
    def loss(g):
        return lambda p: jnp.mean(residual(g)(p, T, X) ** 2)

    ours = jax.jit(jax.grad(
        lambda p: jaxamp.scaled(loss(lambda f, a, k: nest(f, a, k)))({"1": 0.5, "2": 0.5}, p)[0]))(P)
    theirs = jax.grad(loss(lambda f, a, k: nest(f, a, k, jax_grad=True)))(P)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)

    def u16(p, t, x):  # a float16 program: its values round to float16 in every step
        h = jnp.tanh((p[:3] * jnp.stack([t, x, x])).astype(jnp.float16))
        return jnp.sum(h * h[::-1]).astype(jnp.float32) + p[3] * x**3

    scales = {"1": 2.0**-2, "2": 2.0**-4}
    auto = jaxamp.scaled(jax.vmap(nest(u16, 2, 2), (None, 0, 0)))(scales, P, T, X)[0]
    rev = jaxamp.scaled(jax.vmap(nest(u16, 2, 2, method="reverse"), (None, 0, 0)))(scales, P, T, X)[0]
    np.testing.assert_allclose(auto, rev, atol=4e-3 * float(jnp.max(jnp.abs(rev))))


@jax.custom_jvp
def inject(v, bad):
    return v


@inject.defjvp
def _inject_jvp(primals, tangents):
    (v, bad), (dv, _) = primals, tangents
    return v, dv * bad


def test_an_overflow_flags_the_key_of_its_order():
    # u_xx is finite; the step that differentiates it (order 3) meets inf
    third = jax.vmap(nest(lambda p, t, x: inject(nest(u, 2, 2)(p, t, x), p[0] * jnp.inf), 2, 1), (None, 0, 0))
    _, found = jaxamp.scaled(third)({"1": 1.0, "2": 1.0, "3": 1.0}, P, T, X)
    assert {k: bool(v) for k, v in found.items()} == {"1": False, "2": False, "3": True, "nonfinite_values": False}


def test_a_jit_cache_that_skips_calls_falls_back_correctly():
    """The second trace of a program may skip a cached jitted function's calls: the shared
    passes then fall back to the call's own plan, with the same values."""
    inner = jax.jit(lambda p, t, x: nest(u, 2, 1)(p, t, x) + nest(u, 2, 2)(p, t, x))

    def r(p, t, x):
        return inner(p, t, x) * nest(u, 1, 1)(p, t, x) + inner(p, t, x)

    ours = jaxamp.scaled(jax.vmap(r, (None, 0, 0)))({"1": 1.0, "2": 1.0}, P, T, X)[0]
    ref = jax.vmap(lambda p, t, x: (jax.grad(u, 2)(p, t, x) + nest(u, 2, 2, jax_grad=True)(p, t, x))
                   * (jax.grad(u, 1)(p, t, x) + 1.0), (None, 0, 0))(P, T, X)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=1e-5)


def test_shared_passes_cost_fewer_flops_than_nested_reverse_on_an_mlp():
    ws = [jax.random.normal(jax.random.PRNGKey(i), shape) / 4 for i, shape in enumerate([(2, 32), (32, 32), (32, 1)])]

    def mlp(p, t, x):
        h = jnp.stack([t, x])
        for w in p[:-1]:
            h = jnp.tanh(h @ w)
        return (h @ p[-1])[0]

    def flops(kw):
        def r(p, t, x):
            g = lambda k: nest(mlp, 2, k, **kw)(p, t, x)  # noqa: E731
            return nest(mlp, 1, 1, **kw)(p, t, x) + mlp(p, t, x) * g(1) - 0.01 * g(2)

        f = jaxamp.scaled(lambda p: jnp.mean(jax.vmap(r, (None, 0, 0))(p, T, X) ** 2))
        step = jax.jit(jax.grad(lambda p: f({"1": 1.0, "2": 1.0}, p)[0]))
        return step.lower(ws).compile().cost_analysis()["flops"]

    assert flops({}) < flops({"method": "reverse"})


def test_method_errors():
    with pytest.raises(ValueError, match="`method`"):
        jaxamp.grad(u, 2, method="taylor")
    with pytest.raises(ValueError, match="method='forward'"):
        jaxamp.grad(lambda p, xy: jnp.sum(xy**2), 1, method="forward")(P, jnp.ones(2))


def test_a_wrapper_of_a_grad_is_not_that_grad():
    """functools.wraps copies a function's attributes: an outer jaxamp.grad must still
    differentiate the wrapper (a reverse-mode grad, a jacfwd, the user's own), not extend the
    chain of the grad it wraps."""
    import functools

    u = lambda p, t, x: jnp.sin(p * x) * jnp.exp(-t)  # noqa: E731
    u_x = jaxamp.grad(u, 2)
    doubled = functools.wraps(u_x)(lambda *a: 2.0 * u_x(*a))
    cases = {
        "reverse": (jaxamp.grad(jaxamp.grad(u_x, 2, method="reverse"), 2), jax.grad(jax.grad(jax.grad(u, 2), 2), 2)),
        "jacfwd": (jaxamp.grad(jaxamp.jacfwd(u_x, 2), 2), jax.grad(jax.grad(jax.grad(u, 2), 2), 2)),
        "wrapped": (jaxamp.grad(doubled, 2), lambda *a: 2.0 * jax.grad(jax.grad(u, 2), 2)(*a)),
    }
    for name, (ours, want) in cases.items():
        np.testing.assert_allclose(ours(2.0, 0.1, 0.3), want(2.0, 0.1, 0.3), rtol=1e-5, err_msg=name)


def test_has_aux_takes_the_chain_path_with_jax_values_and_aux():
    u = lambda p, t, x: (jnp.sin(p * x) * jnp.exp(-t), {"u": jnp.sin(p * x) * jnp.exp(-t)})  # noqa: E731
    for argnums in (2, (1, 2)):
        ours, want = jaxamp.grad(u, argnums, has_aux=True), jax.grad(u, argnums, has_aux=True)
        assert "jaxamp_chain" in str(jax.make_jaxpr(ours)(2.0, 0.1, 0.3))
        for a, b in zip(jax.tree_util.tree_leaves(ours(2.0, 0.1, 0.3)), jax.tree_util.tree_leaves(want(2.0, 0.1, 0.3))):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    with pytest.raises(TypeError, match="has_aux=True requires `fun` to return a pair"):
        jaxamp.grad(lambda p, t, x: p * x, 2, has_aux=True)(2.0, 0.1, 0.3)
