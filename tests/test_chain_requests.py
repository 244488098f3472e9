"""A derivative of a ``jaxamp.grad`` chain, whatever transformation takes it, is a longer chain in
the program (issue #56): planned with the point's other requests, not the derivative of a plan."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from jaxamp._src.derivatives import chain
from jaxamp._src.derivatives.chain_call import chain_p
from jaxamp._src.derivatives.prune import pruned


def u(p, t, x):
    return jnp.tanh(p[0] * t + p[1] * x) * jnp.sin(p[2] * x)


P = jnp.array([0.7, -1.3, 0.9])


def _chains(closed):
    return [l.argnums for e in closed.jaxpr.eqns if e.primitive is chain_p for l in e.params["links"]]


def test_jax_jvp_of_a_chain_binds_the_longer_chain():
    u_x = jaxamp.grad(u, 2)
    closed = jax.make_jaxpr(lambda t, x: jax.jvp(lambda s: u_x(P, t, s), (x,), (1.0,)))(0.3, 0.5)
    # x is the body's second array argument: the vector P is taken as its entries, after t and x
    assert sorted(_chains(closed), key=len) == [(1,), (1, 1)]
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


def _net(p, z):
    return jnp.tanh(z @ p[0]) @ p[1]


NET = (jax.random.normal(jax.random.PRNGKey(0), (3, 8)), jax.random.normal(jax.random.PRNGKey(1), (8,)))
Z = jnp.array([0.1, -0.2, 0.3])


def test_a_hessians_entries_are_one_equation_and_unread_ones_are_dropped():
    """jaxamp.hessian over a vector binds its entries as one chain equation (one plan); the
    entries a program never reads are dropped from it (its links' dead-code elimination, after
    the program's pass reads the stack through)."""
    full = jax.make_jaxpr(lambda z: jaxamp.hessian(_net, 1)(NET, z))(Z)
    assert [len(e.params["links"]) for e in full.jaxpr.eqns if e.primitive is chain_p] == [6]  # upper triangle
    read = jax.make_jaxpr(lambda z: jaxamp.hessian(_net, 1)(NET, z)[1, 2])(Z)
    assert _chains(pruned(read)) == [(3, 4)]  # the stack read through, the other links dead
    np.testing.assert_allclose(jaxamp.hessian(_net, 1)(NET, Z), jax.hessian(_net, 1)(NET, Z), rtol=2e-5, atol=1e-6)


def test_hessian_of_a_trace_of_a_hessian_reads_only_the_diagonal_inside():
    """A biharmonic as hessian(trace(hessian)): the inner trace's masked select reads the inner
    Hessian's diagonal only (no chain through an off-diagonal inner entry), the values JAX's."""
    inner = lambda p, z: jnp.trace(jaxamp.hessian(_net, 1)(p, z))  # noqa: E731
    f = lambda z: jnp.trace(jaxamp.hessian(inner, 1)(NET, z))  # noqa: E731
    closed = jax.make_jaxpr(f)(Z)
    for steps in _chains(closed):
        assert steps[0] == steps[1], steps  # the inner Hessian's entry: diagonal
    want = jnp.trace(jax.hessian(lambda p, z: jnp.trace(jax.hessian(_net, 1)(p, z)), 1)(NET, Z))
    np.testing.assert_allclose(f(Z), want, rtol=1e-4)


def test_a_direction_of_one_output_is_the_sum_of_steps_another_output_takes():
    """Two bases at one point (two outputs of one network): a pass along an argument is a pass
    of every output, so ``u0``'s step along a direction whose entries' steps ``u2`` takes anyway
    is their sum (no tangent of its own), and with two of them missing it is one tangent."""
    f0, f1 = (lambda t, x, y: t), (lambda t, x, y: x)
    along = chain.Along((1, 2), (0, 1))
    link = lambda f, *steps: chain.Chain(f, steps, (None,) * len(steps), None)  # noqa: E731
    steps = [link(f0, 0, 1), link(f0, 0, 2)]  # canonical: arguments first, in order
    planned, sums = chain._requests(steps + [link(f1, 0, along)], [0, 0, 1])
    assert [c.argnums for _, c in planned] == [(0, 1), (0, 2), (0, 1), (0, 2)]
    assert [b for b, _ in planned] == [0, 0, 1, 1] and sums[2] == [((0,), 2), ((1,), 3)]
    planned, sums = chain._requests([link(f0, 0), link(f1, 0, along)], [0, 1])
    assert [c.argnums for _, c in planned] == [(0,), (0, along)] and sums[1] == [((), 1)]


def _mlp(p, y, z):
    h = jnp.tanh(jnp.stack([y, z]) @ p[0])
    return jnp.tanh(h @ p[1]) @ p[2]


MLP = tuple(jax.random.normal(jax.random.PRNGKey(k), s) / jnp.sqrt(s[0])
            for k, s in enumerate([(2, 32), (32, 32), (32,)]))
YS, ZS = jnp.linspace(-0.5, 0.5, 32), jnp.linspace(0.2, -0.3, 32)


def test_a_level_read_only_as_flags_takes_no_pass_of_its_own():
    """``jacrev(grad(hessian(u, y), z), y)``: its levels u_yy and u_yyz are read only by the checks
    of the levels above them (is the value below finite?), so the plan takes the steps of u_yyzy
    in the order that costs least (a Taylor pass along y, then one jvp along z: the engine's plan
    of ``u__y__y__y__z``) and those checks read its own levels: the scaled step's FLOPs are the
    engine's, the values JAX's, an overflow flagged by its order."""
    amp = jaxamp.AmpConfig()
    net = jaxamp.autocast(_mlp, amp)  # float16
    f = jaxamp.jacrev(jaxamp.grad(jaxamp.hessian(net, 1), 2), 1)
    loss = lambda p, ys, zs: jnp.mean(jax.vmap(f, (None, 0, 0))(p, ys, zs) ** 2)  # noqa: E731
    engine = jaxamp.Derivatives(lambda p, x: net(p, x[0], x[1])[None], inputs=("y", "z"), outputs=("u",),
                                derivatives=["u__y__y__y__z"], amp=amp)
    by_engine = lambda p, ys, zs: jnp.mean(engine(p, jnp.stack([ys, zs], 1))["u__y__y__y__z"] ** 2)  # noqa: E731

    def step_flops(fn):
        state = jaxamp.init(fn, amp, from_profile=False)(MLP, YS, ZS)
        step = jax.jit(lambda p, ys, zs: jaxamp.value_and_grad(fn)(state, p, ys, zs))
        return step.lower(MLP, YS, ZS).compile().cost_analysis()["flops"]

    assert step_flops(loss) <= 1.02 * step_flops(by_engine)
    scaled = jax.jit(jaxamp.scaled(loss, amp))
    want = jnp.mean(jax.vmap(jax.grad(jax.grad(jax.grad(jax.grad(_mlp, 1), 1), 2), 1), (None, 0, 0))(MLP, YS, ZS) ** 2)
    value, found = scaled({k: 1.0 for k in "1234"}, MLP, YS, ZS)
    np.testing.assert_allclose(value, want, rtol=5e-2)  # float16
    assert not any(bool(v) for v in found.values())
    for key in "234":  # a level past float16's range flags its own key, not the bad values
        _, found = scaled({k: 2.0**40 if k == key else 1.0 for k in "1234"}, MLP, YS, ZS)
        assert sorted(k for k, v in found.items() if bool(v)) == [key]


def test_the_plan_takes_a_mixed_partials_steps_in_the_order_that_costs_least():
    """A pure run first is one Taylor pass (u_yyyz: 4 coefficients, then a jvp: 8 values per
    network value, not 16 by the arguments' order); a chain whose prefix another takes is that
    pass (u_zy beside u_zyy: the arguments' order wins); the steps' names are kept as written."""
    c = lambda steps, wrts=None: chain.Chain(u, steps, wrts or (None,) * len(steps), None)  # noqa: E731
    assert [x.argnums for x in chain.ordered([c((2, 1, 1, 1))])] == [(1, 1, 1, 2)]
    assert [x.argnums for x in chain.ordered([c((1, 2)), c((1, 2, 2))])] == [(1, 2), (1, 2, 2)]
    named = c((2, 1, 1, 1), ("x", "t", "t", "t"))
    assert chain.ordered([named]) == [named]


def _mlp_txy(p, t, xy):
    h = jnp.tanh(jnp.concatenate([t[None], xy]) @ p[0])
    return jnp.tanh(h @ p[1]) @ p[2]


MLP3 = tuple(jax.random.normal(jax.random.PRNGKey(k), s) / jnp.sqrt(s[0])
             for k, s in enumerate([(3, 32), (32, 32), (32,)]))
XYS = jnp.stack([jnp.linspace(-0.5, 0.5, 32), jnp.linspace(0.2, -0.3, 32)], 1)


def test_a_jvp_closing_over_a_vector_shares_the_passes_of_a_chain_taking_its_entries():
    """``u_tt + jvp(lambda s: u(p, s, xy), (t,), (c,))``: the grad chain's body takes ``xy`` entry by
    entry, the jvp's closes over it; planned at one point, the jvp's derivative is the value of
    the t-pass that u_tt takes (the engine's plan of ``u__t__t`` and ``u__t``), not a pass of its
    own (seed 120809 #32 of the random idioms: 1.27x the engine's FLOPs); values JAX's."""
    amp = jaxamp.AmpConfig()
    net = jaxamp.autocast(_mlp_txy, amp)  # float16
    u_tt = jaxamp.grad(jaxamp.grad(net, 1), 1)

    def residual(p, t, xy):
        return u_tt(p, t, xy) + jaxamp.jvp(lambda s: net(p, s, xy), (t,), (jnp.float32(-0.57),))[1]

    loss = lambda p, ts, xys: jnp.mean(jax.vmap(residual, (None, 0, 0))(p, ts, xys) ** 2)  # noqa: E731
    engine = jaxamp.Derivatives(lambda p, x: net(p, x[0], x[1:])[None], inputs=("t", "x", "y"), outputs=("u",),
                                derivatives=["u__t__t", "u__t"], amp=amp)

    def by_engine(p, ts, xys):
        d = engine(p, jnp.concatenate([ts[:, None], xys], 1))
        return jnp.mean((d["u__t__t"] - 0.57 * d["u__t"]) ** 2)

    def flops(fn):
        scales = {k: 1.0 for k in "12"}
        return jax.jit(jaxamp.scaled(fn, amp)).lower(scales, MLP3, YS, XYS).compile().cost_analysis()["flops"]

    assert flops(loss) <= 1.02 * flops(by_engine)
    # the points under two vmaps (4 x 8): the same work, the vector read through the outer level's axes
    nested = lambda p, ts, xys: jnp.mean(jax.vmap(jax.vmap(residual, (None, 0, 0)), (None, 0, 0))(  # noqa: E731
        p, ts.reshape(4, 8), xys.reshape(4, 8, 2)) ** 2)
    assert flops(nested) <= 1.02 * flops(loss)
    value, found = jax.jit(jaxamp.scaled(loss, amp))({k: 1.0 for k in "12"}, MLP3, YS, XYS)
    u32_t = jax.grad(_mlp_txy, 1)
    want = jnp.mean(jax.vmap(lambda t, xy: jax.grad(u32_t, 1)(MLP3, t, xy) - 0.57 * u32_t(MLP3, t, xy))(YS, XYS) ** 2)
    np.testing.assert_allclose(value, want, rtol=5e-2)  # float16
    assert not any(bool(v) for v in found.values())
