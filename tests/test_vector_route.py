"""jaxamp.jacfwd / jacrev / hessian along a small float32 vector, planned entry by entry.

Oracles: JAX's own jacfwd / jacrev / hessian (float32 rounding); the program itself (the chain
equations appear where the route applies and not elsewhere; an entry the program never reads
costs no FLOPs: the step equals the nested-grad step's); binary scales give bit-identical
float32 values, and an order's scale pushed past float32 flags that order's key.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES

SIZES = {"w1": (8, 3), "w2": (8,)}


def _u(p, z):
    return jnp.sum(p["w2"] * jnp.tanh(p["w1"] @ z)) + z[0] ** 3 * z[-1]


@pytest.fixture(scope="module")
def pz():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {name: jax.random.normal(kk, shape) for kk, (name, shape) in zip(k, SIZES.items())}
    return p, jnp.array([0.3, -0.2, 0.5]), jax.random.normal(k[2], (5, 3))


def _chained(fn, *args) -> bool:
    return "jaxamp_chain" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("name", ["jacfwd", "jacrev", "hessian"])
def test_values_are_jax_and_the_route_is_planned(pz, name):
    p, z, zs = pz
    ours, theirs = getattr(jaxamp, name)(_u, 1), getattr(jax, name)(_u, 1)
    assert _chained(ours, p, z)
    np.testing.assert_allclose(jax.jit(ours)(p, z), theirs(p, z), rtol=2e-6, atol=2e-6)
    batched = jax.jit(jax.vmap(ours, (None, 0)))(p, zs)
    np.testing.assert_allclose(batched, jax.vmap(theirs, (None, 0))(p, zs), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", ["jacfwd", "jacrev", "hessian"])
def test_other_forms_take_jax_route_with_jax_values(pz, name):
    p, z, _ = pz
    vec = lambda p, z: jnp.tanh(jnp.outer(p["w1"] @ z[:3], z[:3]))  # noqa: E731  (24 values)
    long_u = lambda p, z: _u(p, z[:3]) * jnp.sum(z)  # noqa: E731
    for fn, point in ((vec, z), (long_u, jnp.linspace(-1.0, 1.0, 17))):
        ours = getattr(jaxamp, name)(fn, 1)
        assert not _chained(ours, p, point)
        np.testing.assert_allclose(ours(p, point), getattr(jax, name)(fn, 1)(p, point), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", ["jacfwd", "jacrev", "hessian"])
def test_a_vector_field_and_a_scalar_argument_take_the_route_as_one_request(pz, name):
    """Small float32 values (a vector field, a (2, 2) output) along a vector or a scalar argument:
    one chain equation per call (every entry one request of one plan), JAX's values and layout."""
    p, z, _ = pz
    field = lambda p, z: jnp.tanh(p["w1"] @ z)[:3] * z[0]  # noqa: E731
    square = lambda p, t, z: jnp.tanh(p["w1"][:2, :2] * t + z[0])  # noqa: E731  (a scalar t, 4 values)
    for fn, argnum, args in ((field, 1, (p, z)), (square, 1, (p, jnp.float32(0.7), z)), (_u, 1, (p, z))):
        ours, theirs = getattr(jaxamp, name)(fn, argnum), getattr(jax, name)(fn, argnum)
        closed = jax.make_jaxpr(ours)(*args)
        assert [e.primitive.name for e in closed.jaxpr.eqns].count("jaxamp_chain") == 1
        got, want = jax.jit(ours)(*args), theirs(*args)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_an_entry_the_program_never_reads_costs_nothing(pz):
    p, _, zs = pz
    amp = jaxamp.AmpConfig()

    def flops(residual):
        loss = lambda p, zs: jnp.mean(jax.vmap(residual, (None, 0))(p, zs) ** 2)  # noqa: E731
        state = jaxamp.init(loss, amp, from_profile=False)(p, zs)
        step = jax.jit(lambda p, zs: jaxamp.value_and_grad(loss)(state, p, zs))
        return step.lower(p, zs).compile().cost_analysis()["flops"]

    def nested(p, z):
        scalar = lambda p, a, b, c: _u(p, jnp.stack([a, b, c]))  # noqa: E731
        return jaxamp.grad(jaxamp.grad(scalar, 2), 2)(p, *z)

    entry = flops(lambda p, z: jaxamp.hessian(_u, 1)(p, z)[1, 1])
    assert entry <= 1.02 * flops(nested)
    assert entry < 0.8 * flops(lambda p, z: jnp.sum(jaxamp.hessian(_u, 1)(p, z)))


def test_binary_scales_change_no_bit_and_an_order_past_float32_is_flagged(pz):
    p, z, _ = pz
    run = jax.jit(jaxamp.scaled(lambda p, z: jaxamp.hessian(_u, 1)(p, z) + jaxamp.jacrev(_u, 1)(p, z)))
    one, _ = run({"1": 1.0, "2": 1.0}, p, z)
    values, found = run({"1": 2.0**-5, "2": 2.0**9}, p, z)
    np.testing.assert_array_equal(values, one)
    assert not any(bool(v) for v in found.values())
    _, found = run({"1": 1.0, "2": 2.0**200}, p, z)
    assert {k: bool(v) for k, v in found.items()} == {"1": False, "2": True, NONFINITE_VALUES: False}


def test_a_vector_first_met_inside_a_branch_is_reused_outside(pz):
    p, z, _ = pz
    jac = jaxamp.jacfwd(_u, 1)

    def fn(p, z):
        inside = jax.lax.cond(z[0] > 0, lambda: jac(p, z), lambda: -jac(p, z))
        return inside + jac(p, z)

    np.testing.assert_allclose(jax.jit(fn)(p, z), 2 * jax.jacfwd(_u, 1)(p, z), rtol=2e-6, atol=2e-6)


def test_nothing_outlives_the_derivative_function(pz):
    import gc
    import weakref

    p, z, _ = pz
    fun = lambda p, z: _u(p, z) * 2.0  # noqa: E731
    alive = weakref.ref(fun)
    hess = jaxamp.hessian(fun, 1)
    jax.make_jaxpr(jaxamp.scaled(hess))({"1": 1.0, "2": 1.0}, p, z)
    del fun, hess
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("name", ["jacfwd", "hessian"])
def test_an_equinox_module_takes_the_route(name):
    eqx = pytest.importorskip("equinox")
    net = eqx.nn.MLP(2, "scalar", 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    z = jnp.array([0.3, -0.4])
    ours = getattr(jaxamp, name)(net)
    assert _chained(ours, z)
    np.testing.assert_allclose(ours(z), getattr(jax, name)(net)(z), rtol=2e-6, atol=2e-6)


# ---------------------------------------------------------------- a pytree of coordinates
def _dict_net():
    import jax

    W = jax.random.normal(jax.random.PRNGKey(0), (4, 8)) / 2.0
    V = jax.random.normal(jax.random.PRNGKey(1), (8, 3)) / 3.0

    def U(p, d):
        z = jnp.concatenate([d["t"][None], d["xy"], d["s"][None]])
        return jnp.tanh(z @ p[0]) @ p[1]

    d = {"t": jnp.float32(0.3), "xy": jnp.array([0.1, -0.2], jnp.float32), "s": jnp.float32(0.5)}
    return U, (W, V), d


@pytest.mark.slow  # (the fast suite's budget)
def test_derivatives_along_a_dict_of_coordinates_have_jaxs_layout_and_values():
    """grad / jacrev / jacfwd / hessian along ``{"t": t, "xy": xy, "s": s}`` (entry by entry,
    planned) give JAX's nested structure, shapes and values, under vmap and jit too."""
    import jax

    U, P, d = _dict_net()
    u0 = lambda p, d: U(p, d)[0]  # noqa: E731
    T = jnp.linspace(0.0, 1.0, 5)
    for ours, theirs in ((jaxamp.grad(u0, 1), jax.grad(u0, 1)), (jaxamp.jacrev(U, 1), jax.jacrev(U, 1)),
                         (jaxamp.jacfwd(U, 1), jax.jacfwd(U, 1)), (jaxamp.hessian(u0, 1), jax.hessian(u0, 1)),
                         (jaxamp.jacfwd(jaxamp.jacrev(u0, 1), 1), jax.jacfwd(jax.jacrev(u0, 1), 1))):
        got, want = ours(P, d), theirs(P, d)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        run = lambda f: jax.jit(jax.vmap(lambda t: jax.tree_util.tree_leaves(f(P, {**d, "t": t}))))(T)  # noqa: E731
        for a, b in zip(run(ours), run(theirs)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # (the fast suite's budget)
def test_the_trace_of_a_raveled_dict_hessian_plans_its_diagonal_only():
    """The Hessian over a dict, joined into a matrix by the user (concatenates of its blocks) and
    traced under vmap: a scaled step plans the 4 diagonal entries, not the 10 of the triangle."""
    import jax

    from jaxamp._src.core.interpreter import trace
    from jaxamp._src.derivatives.chain_call import chain_p
    from jaxamp._src.derivatives.prune import pruned

    U, P, d = _dict_net()
    u0 = lambda p, d: U(p, d)[0]  # noqa: E731

    def matrix(h):  # each row block raveled along the columns, then the blocks joined
        def row(a):
            lead = jnp.shape(d[a])
            return jnp.reshape(jnp.concatenate([jnp.reshape(h[a][b], lead + (jnp.size(d[b]),))
                                                for b in ("t", "xy", "s")], axis=-1), (jnp.size(d[a]), -1))
        return jnp.concatenate([row(a) for a in ("t", "xy", "s")], axis=0)

    def loss(p, T):
        lap = jax.vmap(lambda t: jnp.trace(matrix(jaxamp.hessian(u0, 1)(p, {**d, "t": t}))))(T)
        return jnp.mean(lap ** 2)

    closed = pruned(trace(loss, (P, jnp.linspace(0.0, 1.0, 8)), {})[0])  # the entry points' first pass
    links = [len(e.params["links"]) for e in closed.jaxpr.eqns if e.primitive is chain_p]
    value, found = jaxamp.scaled(loss)(jaxamp.init(loss, jaxamp.AmpConfig(), from_profile=False)(P, jnp.zeros(8)),
                                       P, jnp.linspace(0.0, 1.0, 8))
    want = jnp.mean(jax.vmap(lambda t: jnp.trace(matrix(jax.hessian(u0, 1)(P, {**d, "t": t}))))(
        jnp.linspace(0.0, 1.0, 8)) ** 2)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    assert links == [4], links


def _step_flops(residual, p, zs):
    """XLA FLOPs of a scaled fp16-config step of the mean squared ``residual`` over ``zs``."""
    loss = lambda p, zs: jnp.mean(jax.vmap(residual, (None, 0))(p, zs) ** 2)  # noqa: E731
    state = jaxamp.init(loss, jaxamp.AmpConfig(), from_profile=False)(p, zs)
    step = jax.jit(lambda p, zs: jaxamp.value_and_grad(loss)(state, p, zs))
    return step.lower(p, zs).compile().cost_analysis()["flops"]


def test_jvp_along_a_vector_is_one_request_with_jaxs_values(pz):
    """jaxamp.jvp along a small vector binds one chain equation (a direction step); its values
    are jax.jvp's alone, nested (grad, hessian of it), under vmap and jit, and scaled."""
    p, z, zs = pz
    v = jnp.array([1.0, -2.0, 0.5])
    ours = lambda p, z: jaxamp.jvp(lambda z: _u(p, z), (z,), (v,))[1]  # noqa: E731
    theirs = lambda p, z: jax.jvp(lambda z: _u(p, z), (z,), (v,))[1]  # noqa: E731
    assert _chained(ours, p, z)
    for o, t in ((ours, theirs), (jaxamp.grad(ours, 1), jax.grad(theirs, 1)),
                 (jaxamp.hessian(ours, 1), jax.hessian(theirs, 1))):
        np.testing.assert_allclose(jax.jit(jax.vmap(o, (None, 0)))(p, zs), jax.vmap(t, (None, 0))(p, zs),
                                   rtol=2e-5, atol=2e-5)
    scaled = jax.jit(jaxamp.scaled(jax.vmap(jaxamp.grad(ours, 1), (None, 0))))
    one, _ = scaled({"1": 1.0, "2": 1.0}, p, zs)
    values, found = scaled({"1": 2.0**-5, "2": 2.0**9}, p, zs)
    np.testing.assert_array_equal(values, one)  # binary scales change no bit
    assert not any(bool(f) for f in found.values())
    np.testing.assert_allclose(one, jax.vmap(jax.grad(theirs, 1), (None, 0))(p, zs), rtol=2e-5, atol=2e-5)


def test_a_direction_is_one_tangent_or_the_sum_of_steps_computed_anyway(pz):
    """The plan takes a jvp along a vector as one tangent where the entries' steps are not
    computed otherwise (cheaper than the Jacobian), and as their sum where they are (it costs
    nothing beside the Jacobian)."""
    k = jax.random.split(jax.random.PRNGKey(1), 3)  # a network whose passes dominate the step's FLOPs
    p = {"w1": jax.random.normal(k[0], (64, 3)), "w2": jax.random.normal(k[1], (64,))}
    zs = jax.random.normal(k[2], (64, 3))
    v = jnp.array([1.0, -2.0, 0.5])
    jvp = lambda p, z: jaxamp.jvp(lambda z: _u(p, z), (z,), (v,))[1]  # noqa: E731 (p a closure: one point still)
    jac = lambda p, z: jnp.sum(jaxamp.jacfwd(_u, 1)(p, z))  # noqa: E731
    contracted = lambda p, z: jaxamp.jacfwd(_u, 1)(p, z) @ v  # noqa: E731
    assert _step_flops(jvp, p, zs) < 0.8 * _step_flops(jac, p, zs)
    assert _step_flops(lambda p, z: jvp(p, z) + jac(p, z), p, zs) <= 1.02 * _step_flops(
        lambda p, z: contracted(p, z) + jac(p, z), p, zs)


def test_grad_along_a_vector_and_a_laplacian_along_one_entry_are_chains(pz):
    p, z, zs = pz
    g = jaxamp.grad(_u, 1)
    assert _chained(g, p, z)
    np.testing.assert_allclose(jax.jit(jax.vmap(g, (None, 0)))(p, zs), jax.vmap(jax.grad(_u, 1), (None, 0))(p, zs),
                               rtol=2e-6, atol=2e-6)
    along_t = lambda p, t, z: _u(p, z.at[0].set(t))  # noqa: E731
    lap = jaxamp.laplacian(along_t, 1, of="u")
    assert _chained(lap, p, z[0], z)
    np.testing.assert_allclose(lap(p, z[0], z), jax.hessian(along_t, 1)(p, z[0], z), rtol=2e-6, atol=2e-6)
    _, found = jaxamp.scaled(lap, jaxamp.AmpConfig(mode="per_term_scaler"))({"u": 1.0, "u__lap": 1.0}, p, z[0], z)
    assert set(found) == {"u", "u__lap", NONFINITE_VALUES}  # the keys of the collapsed Laplacian


@pytest.mark.slow  # (the fast suite's budget)
def test_a_jacobian_of_a_pytree_value_has_jaxs_layout_on_either_route():
    """jacrev / jacfwd of a function returning a dict (a gradient along a dict): JAX's layout
    and values, as chains when small, by JAX's route past 16 entries."""
    u = lambda p, z: jnp.tanh(p * z["t"] * jnp.sum(z["x"]) + z["t"] ** 2)  # noqa: E731
    z = {"t": jnp.float32(0.3), "x": jnp.array([0.5, -0.2])}
    for name in ("jacrev", "jacfwd"):
        ours, theirs = getattr(jaxamp, name)(jaxamp.grad(u, 1), 1), getattr(jax, name)(jax.grad(u, 1), 1)
        assert _chained(ours, 1.5, z)
        a, b = ours(1.5, z), theirs(1.5, z)
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
        jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-6, atol=2e-6), a, b)
    long = lambda p, z: {"a": jnp.sin(p * z[:3]).sum(), "b": z * z[0]}  # noqa: E731 (20 entries of z)
    z = jnp.linspace(0.1, 1.0, 20)
    for name in ("jacrev", "jacfwd"):
        a, b = getattr(jaxamp, name)(long, 1)(2.0, z), getattr(jax, name)(long, 1)(2.0, z)
        jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-6, atol=2e-6), a, b)


def test_the_trace_of_a_raveled_dict_jacobian_of_a_gradient_plans_its_diagonal_only():
    """``trace(ravel(jacrev(ravel(grad(u, dict)), dict)))`` over ``{"t": t, "x": x}``, ``x`` of
    one entry (a derivative of derivatives: each entry a chain one step longer): blocks one entry
    thick, joined by the user's concatenates, still read as the entries, so the plan holds the 2
    diagonal second orders (and their first), not the mixed ones."""
    import jax

    from jaxamp._src.core.interpreter import trace
    from jaxamp._src.derivatives.chain_call import chain_p
    from jaxamp._src.derivatives.prune import pruned

    W = jax.random.normal(jax.random.PRNGKey(0), (2, 8)) / 2.0
    P = (W, jax.random.normal(jax.random.PRNGKey(1), (8,)) / 3.0)
    u0 = lambda p, d: jnp.tanh(jnp.concatenate([d["t"][None], d["x"]]) @ p[0]) @ p[1]  # noqa: E731
    d = {"t": jnp.float32(0.3), "x": jnp.array([0.1], jnp.float32)}

    def ravel(g, lead=()):
        return jnp.concatenate([jnp.reshape(g[k], lead + (jnp.size(d[k]),)) for k in ("t", "x")], axis=-1)

    def residual(f, grad):
        def one(p, t):
            return jnp.trace(ravel(f(lambda p, z: ravel(grad(u0, 1)(p, z)), 1)(p, {**d, "t": t}), (2,)))
        return one

    T = jnp.linspace(0.0, 1.0, 8)
    loss = lambda p, T: jnp.mean(jax.vmap(residual(jaxamp.jacrev, jaxamp.grad), (None, 0))(p, T) ** 2)  # noqa: E731
    closed = pruned(trace(loss, (P, T), {})[0])
    links = [[link.argnums for link in e.params["links"]] for e in closed.jaxpr.eqns if e.primitive is chain_p]
    assert len(links) == 1 and sorted(links[0]) == [(2,), (2, 2), (3,), (3, 3)], links
    value, _ = jaxamp.scaled(loss)(jaxamp.init(loss, jaxamp.AmpConfig(), from_profile=False)(P, T), P, T)
    want = jnp.mean(jax.vmap(residual(jax.jacrev, jax.grad), (None, 0))(P, T) ** 2)
    np.testing.assert_allclose(value, want, rtol=1e-5)


@pytest.mark.slow  # (the fast suite's budget)
def test_a_jvp_closing_over_a_vector_a_derivative_steps_along_is_planned_with_it():
    """``trace(hessian_x(jvp(lambda t: u(p, t, x), t)))`` (the jvp's function closes over ``x``,
    a small vector the Hessian takes entry by entry) beside ``u_tt``: the inner chain is bound
    with ``x``'s entries among its point's arguments, so each step along an entry is that chain
    one step longer, planned with the point's other requests, and the entries a step does not
    move carry no tangent (the trace reads no mixed entry): the step's FLOPs are those of the same
    derivatives written as ``grad`` nests, the values JAX's."""
    k = jax.random.split(jax.random.PRNGKey(2), 3)
    p = {"w1": jax.random.normal(k[0], (32, 3)), "w2": jax.random.normal(k[1], (32,))}
    ts, xs = jax.random.normal(k[2], (64, 3))[:, 0], jax.random.normal(k[2], (64, 3))[:, 1:]
    u = lambda p, t, x: _u(p, jnp.concatenate([t[None], x]))  # noqa: E731

    def closing(lib):
        inner = lambda p, t, x: lib.jvp(lambda s: u(p, s, x), (t,), (jnp.float32(1.0),))[1]  # noqa: E731
        return lambda p, t, x: jnp.trace(lib.hessian(inner, 2)(p, t, x)) + lib.grad(lib.grad(u, 1), 1)(p, t, x)

    def nested(p, t, x):
        return jnp.trace(jaxamp.hessian(jaxamp.grad(u, 1), 2)(p, t, x)) + jaxamp.grad(jaxamp.grad(u, 1), 1)(p, t, x)

    def flops(residual):
        loss = lambda p, ts, xs: jnp.mean(jax.vmap(residual, (None, 0, 0))(p, ts, xs) ** 2)  # noqa: E731
        state = jaxamp.init(loss, jaxamp.AmpConfig(), from_profile=False)(p, ts, xs)
        step = jax.jit(lambda p, ts, xs: jaxamp.value_and_grad(loss)(state, p, ts, xs))
        return step.lower(p, ts, xs).compile().cost_analysis()["flops"]

    assert flops(closing(jaxamp)) <= 1.01 * flops(nested)
    np.testing.assert_allclose(jax.jit(jax.vmap(closing(jaxamp), (None, 0, 0)))(p, ts, xs),
                               jax.vmap(closing(jax), (None, 0, 0))(p, ts, xs), rtol=2e-5, atol=2e-5)
