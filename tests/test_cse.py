"""jaxamp._src.core.interpreter.cse: repeated scale-free work removed before differentiation.

Oracles: the program's own values (a merge never changes one), the count of equations, and
XLA's FLOPs of the differentiated program (one backward pass where two were written).
"""

import jax
import pytest
import jax.numpy as jnp
import numpy as np

import jaxamp
from jaxamp._src.core.interpreter import bind, cse, eval_jaxpr


def _run(closed, *args):
    return eval_jaxpr(closed.jaxpr, closed.consts, list(args), bind)


def test_repeats_are_merged_and_values_kept():
    def f(x, y):
        a = jnp.tanh(x * y) + jnp.tanh(x * y)
        return a * jnp.sin(y), jnp.sin(y)

    closed = jax.make_jaxpr(f)(1.0, 2.0)
    merged = cse(closed)
    names = [e.primitive.name for e in merged.jaxpr.eqns]
    assert names.count("tanh") == 1 and names.count("sin") == 1 and names.count("mul") == 2
    args = (jnp.float32(0.3), jnp.float32(-1.2))
    for got, want in zip(_run(merged, *args), f(*args)):
        np.testing.assert_array_equal(got, want)


def test_signed_zeros_nan_payloads_and_held_inputs_are_not_merged():
    closed = jax.make_jaxpr(lambda x: (x * 0.0, x * -0.0))(1.0)
    assert len(cse(closed).jaxpr.eqns) == 2  # x * 0.0 and x * -0.0 differ for x < 0
    closed = jax.make_jaxpr(lambda s, x: (jnp.sin(s * x), jnp.sin(s * x), jnp.cos(x), jnp.cos(x)))(1.0, 2.0)
    names = [e.primitive.name for e in cse(closed, held=[0]).jaxpr.eqns]
    assert names.count("sin") == 2 and names.count("mul") == 2 and names.count("cos") == 1


def test_effects_are_never_merged():
    def f(x):
        jax.debug.print("{}", x)
        jax.debug.print("{}", x)
        return x

    closed = jax.make_jaxpr(f)(1.0)
    assert len(cse(closed).jaxpr.eqns) == len(closed.jaxpr.eqns) == 2


def test_two_traces_of_one_body_are_merged_and_different_bodies_are_not():
    """Calls holding a body (``jax.checkpoint`` here; ``jaxamp.autocast``'s boundary, a
    ``jax.jit`` call) traced twice hold two jaxpr objects of one program: merged by the
    program they print and their constants; a body computing something else stays."""
    def f(x):
        a = jax.checkpoint(lambda z: jnp.sin(z) * 2.0)(x)
        b = jax.checkpoint(lambda z: jnp.sin(z) * 2.0)(x)
        c = jax.checkpoint(lambda z: jnp.sin(z) * 3.0)(x)
        return a + b, c

    closed = jax.make_jaxpr(f)(1.0)
    calls = [e for e in closed.jaxpr.eqns if "jaxpr" in e.params]
    assert len(calls) == 3 and calls[0].params["jaxpr"] is not calls[1].params["jaxpr"]
    merged = cse(closed)
    assert sum("jaxpr" in e.params for e in merged.jaxpr.eqns) == 2
    for got, want in zip(_run(merged, jnp.float32(0.7)), f(jnp.float32(0.7))):
        np.testing.assert_array_equal(got, want)


def test_bodies_printing_alike_with_different_rules_are_not_merged():
    """Two custom_jvp functions print one program (their rules show by name only): their
    bodies stay apart and each keeps its own derivative; two traces of one of them merge."""
    f = jax.custom_jvp(lambda x: jnp.sin(x))
    f.defjvp(lambda p, t: (jnp.sin(p[0]), t[0] * 2.0))
    g = jax.custom_jvp(lambda x: jnp.sin(x))
    g.defjvp(lambda p, t: (jnp.sin(p[0]), t[0] * 3.0))
    closed = jax.make_jaxpr(lambda x: (jax.checkpoint(f)(x), jax.checkpoint(g)(x), jax.checkpoint(f)(x)))(1.0)
    merged = cse(closed)
    assert len(closed.jaxpr.eqns) == 3 and len(merged.jaxpr.eqns) == 2
    tangents = jax.jvp(lambda x: jnp.stack(_run(merged, x)), (1.0,), (1.0,))[1]
    np.testing.assert_array_equal(tangents, [2.0, 3.0, 2.0])


def test_outputs_of_one_autocast_network_share_their_passes_in_the_step():
    """The divergence of an autocast network's 3 outputs beside each output's Laplacian (a
    vector field's terms; each output's ``hessian`` traces the network again): the step's
    FLOPs are those of the same derivatives by the engine, one network per pass (its
    traces merged before the step differentiates them)."""
    k = jax.random.split(jax.random.PRNGKey(4), 3)
    p = {"w1": jax.random.normal(k[0], (3, 32)) / 2, "w2": jax.random.normal(k[1], (32, 3)) / 4}
    zs = jax.random.uniform(k[2], (32, 3), minval=-1.0, maxval=1.0)
    amp = jaxamp.AmpConfig()
    U = jaxamp.autocast(lambda p, z: jnp.tanh(z @ p["w1"]) @ p["w2"], amp)

    def residual(p, z):
        div = jnp.trace(jaxamp.jacfwd(U, 1)(p, z))
        return div + sum(jnp.trace(jaxamp.hessian(lambda p, z, i=i: U(p, z)[i], 1)(p, z)) for i in range(3))

    eng = jaxamp.Derivatives(lambda p, z: U(p, z), inputs=("t", "x", "y"), outputs=("u", "v", "w"), amp=amp,
                             derivatives=[f"{o}__{c}" for o in "uvw" for c in "txy"]
                             + [f"{o}__{c}__{c}" for o in "uvw" for c in "txy"])

    def engine(p, zs):
        d = eng(p, zs)
        return (d["u__t"] + d["v__x"] + d["w__y"] + sum(d[f"{o}__{c}__{c}"] for o in "uvw" for c in "txy"))

    def flops(fn):
        f = jaxamp.scaled(lambda p: jnp.mean(fn(p, zs) ** 2), amp)
        scales = {key: 1.0 for key in ("1", "2")}
        return jax.jit(jax.grad(lambda p: f(scales, p)[0])).lower(p).compile().cost_analysis()["flops"]

    assert flops(jax.vmap(residual, (None, 0))) <= 1.03 * flops(engine)


def _mlp_params(outputs):
    shapes = [(2, 32), (32, 32), (32, outputs)]
    return [jax.random.normal(jax.random.PRNGKey(i), s) / 4 for i, s in enumerate(shapes)]


def _net(p, t, x):
    h = jnp.stack([t, x]).astype(jnp.float16)
    for w in p[:-1]:
        h = jnp.tanh(h @ w.astype(jnp.float16))
    return (h @ p[-1].astype(jnp.float16)).astype(jnp.float32)


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_a_users_own_call_beside_its_derivatives_costs_no_extra_backward_pass():
    """u(p, t, x) beside jaxamp.grad(u): with the merge, the step costs what the derivatives
    alone cost; written without the merge, the extra primal and its backward pass show."""
    p, pts = _mlp_params(1), jax.random.uniform(jax.random.PRNGKey(9), (64, 2))
    u = lambda p, t, x: _net(p, t, x)[0]  # noqa: E731
    u_x = jaxamp.grad(u, 2)
    u_xx = jaxamp.grad(u_x, 2)

    def flops(with_u, merge):
        def r(p, t, x):
            out = u_x(p, t, x) - 0.1 * u_xx(p, t, x)
            return out + u(p, t, x) * u_x(p, t, x) if with_u else out

        loss = lambda p: jnp.mean(jax.vmap(r, (None, 0, 0))(p, pts[:, 0], pts[:, 1]) ** 2)  # noqa: E731
        f = jaxamp.scaled(loss, merge=merge)
        step = jax.jit(jax.grad(lambda p: f({"1": 0.5, "2": 0.25}, p)[0]))
        return step.lower(p).compile().cost_analysis()["flops"]

    alone, merged, written = flops(False, True), flops(True, True), flops(True, False)
    assert merged < 1.02 * alone < written / 1.1


def test_outputs_of_one_network_share_their_passes():
    """u_x, v_x, u_xx, v_xx of two outputs of one network cost what the same derivatives of
    one output cost (one pass per path for both outputs), and equal JAX's own."""
    p, pts = _mlp_params(2), jax.random.uniform(jax.random.PRNGKey(9), (64, 2))
    comps = [lambda p, t, x, i=i: _net(p, t, x)[i] for i in range(2)]

    def loss_of(bases, grad):
        def r(p, t, x):
            return sum(grad(grad(b, 2), 2)(p, t, x) + grad(b, 1)(p, t, x) for b in bases)

        return lambda p: jnp.mean(jax.vmap(r, (None, 0, 0))(p, pts[:, 0], pts[:, 1]) ** 2)

    def flops(bases):
        f = jaxamp.scaled(loss_of(bases, jaxamp.grad))
        step = jax.jit(jax.grad(lambda p: f({"1": 1.0, "2": 1.0}, p)[0]))
        return step.lower(p).compile().cost_analysis()["flops"]

    assert flops(comps) < 1.05 * flops(comps[:1])
    got = jax.jit(jaxamp.scaled(loss_of(comps, jaxamp.grad)))({"1": 0.5, "2": 0.25}, p)[0]
    want = jax.jit(loss_of(comps, jax.grad))(p)
    np.testing.assert_allclose(got, want, rtol=2e-2)  # float16 network: fp16 rounding


def test_reads_of_the_same_entries_are_one_array_whatever_reads_them():
    """A read (slices, squeezes, reshapes, transposes, broadcasts, stacks, concatenations) is the
    entries it reads, in their layout: a stack of relabelings is the earlier stack; the columns
    of ``m`` stacked and the rows of ``m.T`` stacked are one array; a stack of a vector's
    entries in order is the vector; other entries, or another order, stay apart."""
    def f(a, b, m, v):
        z = jnp.stack([a, b])  # [2, 3]
        again = jnp.stack([jnp.squeeze(a[None, :]), jnp.reshape(b[:, None], (3,))])  # the same values
        swapped = jnp.stack([m.T[0], m.T[1]])  # the same entries as the columns' stack
        whole = jnp.stack([v[0], v[1], v[2]])  # v itself
        reversed_ = jnp.stack([v[2], v[1], v[0]])  # another order
        return (jnp.tanh(z), jnp.tanh(again), jnp.tanh(jnp.stack([m[:, 0], m[:, 1]])), jnp.tanh(swapped),
                jnp.sin(whole), jnp.sin(v), jnp.sin(reversed_))

    args = (jnp.arange(3.0), -jnp.arange(3.0), jnp.arange(6.0).reshape(3, 2), jnp.array([0.5, -1.0, 2.0]))
    merged = cse(jax.make_jaxpr(f)(*args))
    names = [e.primitive.name for e in merged.jaxpr.eqns]
    assert names.count("tanh") == 2 and names.count("sin") == 2
    for got, want in zip(_run(merged, *args), f(*args)):
        np.testing.assert_array_equal(got, want)
