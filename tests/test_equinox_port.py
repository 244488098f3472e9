"""Equinox as first-class as Flax linen: the port of an Equinox tutorial-style PINN
(examples/equinox_user) and the library behaviour it rests on.

Oracles: JAX's own derivatives of the module (``jax.grad(jax.grad(net))``, the unbound
``type(net).__call__``, a closure over the module's arrays) in float32, to rounding;
``eqx.filter_value_and_grad``'s gradients (module-shaped, ``None`` at non-array leaves);
fp32.py itself for the port with AMP off (``AmpConfig(enabled=False)``). Tiny sizes, few steps.
"""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._src.derivatives.chain import Chain
from tests.helpers.port_diff import added_lines

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "equinox_user"
SMALL = ["--points", "32"]
S = {"1": 1.0, "2": 2.0**-3}
X = jnp.linspace(0.05, 0.95, 7)


def net_of(seed=0, activation=jax.nn.tanh):  # activation: a PjitFunction leaf of the module
    return eqx.nn.MLP("scalar", "scalar", 8, 2, activation=activation, key=jax.random.PRNGKey(seed))


def test_the_port_changes_at_most_10_lines_no_lambda_no_partition_autocast_once():
    fp32, fp16 = ((EXAMPLE / f).read_text().split('"""', 2)[2] for f in ("fp32.py", "fp16.py"))  # the code
    assert "jaxamp" not in fp32
    for idiom in ("jax.grad(jax.grad(net))", "eqx.filter_value_and_grad(", "@eqx.filter_jit", "eqx.apply_updates("):
        assert idiom in fp32, idiom
    assert "jax.grad(" not in fp16 and "filter_value_and_grad" not in fp16 and fp16.count("autocast(") == 1
    for banned in ("lambda", "eqx.partition", "eqx.combine", "params_argnums"):
        assert banned not in fp16, banned
    added = added_lines(EXAMPLE / "fp32.py", EXAMPLE / "fp16.py")
    assert 1 <= len(added) <= 10 and all(len(line) <= 100 for line in added), "\n".join(added)


@pytest.mark.slow  # trains the port end to end: the behaviour it rests on is tested fast below
def test_the_port_trains():
    from examples.equinox_user import fp16

    losses = np.array(fp16.main(["--steps", "100"] + SMALL)["losses"])
    assert np.isfinite(losses).all() and losses[-10:].mean() < 0.5 * losses[:10].mean(), losses


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
def test_the_port_with_amp_off_is_fp32(monkeypatch):
    from examples.equinox_user import fp16, fp32

    monkeypatch.setattr(fp16, "amp", jaxamp.AmpConfig(enabled=False))
    ours, theirs = fp16.main(["--steps", "30"] + SMALL), fp32.main(["--steps", "30"] + SMALL)
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-5)


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
@pytest.mark.parametrize("form", ["module", "unbound", "closure"])
def test_grad_of_a_module_equals_jax_grad_in_float32(form):
    net = net_of()

    def u_xx(g, net, x):
        if form == "module":
            return g(g(net))(x)
        if form == "unbound":
            return g(g(type(net).__call__, argnums=1), argnums=1)(net, x)
        return g(g(lambda x: net(x)))(x)  # a closure over the module's arrays

    theirs = jax.vmap(lambda x: u_xx(jax.grad, net, x))(X)
    plain = jax.vmap(lambda x: u_xx(jaxamp.grad, net, x))(X)  # outside scaled: scale 1
    loss = lambda net, x: jnp.sum(jax.vmap(lambda x: u_xx(jaxamp.grad, net, x))(x))  # noqa: E731
    value, found = eqx.filter_jit(jaxamp.scaled(loss))(S, net, X)
    np.testing.assert_allclose(plain, theirs, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(value, jnp.sum(theirs), rtol=2e-5, atol=1e-5)
    assert not any(bool(v) for v in found.values()), found


def test_chains_are_keyed_by_identity_never_by_hashing_the_module():
    net = net_of()
    a, b = Chain(net, (0,), (None,), None), Chain(net, (0,), (None,), None)
    assert a == b and hash(a) == hash(b) and a != Chain(net_of(), (0,), (None,), None)

    def traced(net):  # the module's leaves are tracers: unhashable
        return Chain(net, (0,), (None,), None) in {Chain(net, (0,), (None,), None): 1}

    assert eqx.filter_jit(traced)(net)


def _loss(net, x):
    return jnp.mean(jax.vmap(jaxamp.grad(jaxamp.grad(net)))(x) ** 2) + net(0.0) ** 2


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
def test_value_and_grad_of_a_module_is_filter_value_and_grad():
    net = net_of()
    state = jaxamp.init(_loss, jaxamp.AmpConfig())(net, X)  # nothing autocast: float32 values
    loss, grads, _ = eqx.filter_jit(jaxamp.value_and_grad(_loss))(state, net, X)
    their_loss, theirs = eqx.filter_value_and_grad(_loss)(net, X)
    assert isinstance(grads, eqx.nn.MLP) and grads.activation is None
    assert jax.tree.structure(grads) == jax.tree.structure(theirs)
    np.testing.assert_allclose(loss, their_loss, rtol=1e-6)
    for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(g, t, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
def test_optimizer_update_and_apply_updates_on_module_gradients():
    net, amp = net_of(), jaxamp.AmpConfig()
    optim = jaxamp.optimizer(optax.adam(1e-2), amp_state=jaxamp.init(_loss, amp)(net, X))
    opt_state = optim.init(eqx.filter(net, eqx.is_array))

    @eqx.filter_jit
    def step(net, opt_state):
        loss, grads, flags = jaxamp.value_and_grad(_loss)(opt_state, net, X)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(net, eqx.is_array), flags=flags)
        return eqx.apply_updates(net, updates), opt_state, loss

    first = None
    for _ in range(5):
        net, opt_state, loss = step(net, opt_state)
        first = float(loss) if first is None else first
    assert np.isfinite(float(loss)) and float(loss) < first and int(opt_state.consecutive_skips) == 0
    assert net.activation is jax.nn.tanh  # static leaves kept


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
def test_unbound_method_under_value_and_grad():
    net = net_of()

    def loss(net, x):
        u_x = jax.vmap(jaxamp.grad(type(net).__call__, argnums=1), (None, 0))(net, x)
        return jnp.mean(u_x**2)

    state = jaxamp.init(loss, jaxamp.AmpConfig())(net, X)
    value, grads, _ = jaxamp.value_and_grad(loss)(state, net, X)
    np.testing.assert_allclose(value, loss(net, X), rtol=1e-6)
    assert grads.activation is None and grads.layers[0].weight.shape == net.layers[0].weight.shape


def test_autocast_of_a_module_needs_no_params_argnums():
    net, amp = eqx.nn.MLP(2, "scalar", 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0)), jaxamp.AmpConfig()
    z = jnp.array([0.3, -0.4])
    ours, explicit = jaxamp.autocast(net, amp), jaxamp.autocast(net, amp, params_argnums=())
    assert float(ours(z)) == float(explicit(z)) and abs(float(ours(z)) - float(net(z))) < 1e-2
    program = str(jax.make_jaxpr(ours)(z))
    assert "f16[16,16]" in program and "fn='MLP(...)'" in program  # hidden layers in float16


def test_autocast_of_a_module_is_a_module_with_the_same_leaves_that_trains():
    """A library that takes "a module" (jinns's ``eqx_network=``) trains the placed network:
    ``autocast(net)`` is an ``eqx.Module`` whose arrays are ``net``'s, whose module gradients are
    ``net``'s under ``.module``, and ``eqx.apply_updates`` keeps it placed."""
    net, amp = eqx.nn.MLP(2, "scalar", 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0)), jaxamp.AmpConfig()
    placed, z = jaxamp.autocast(net, amp), jnp.array([0.3, -0.4])
    assert isinstance(placed, eqx.Module)
    arrays = lambda m: jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
    leaves, own = arrays(placed), arrays(net)
    assert len(leaves) == len(own) and all(a is b for a, b in zip(leaves, own))
    assert float(placed(z)) == float(jaxamp.autocast(net, amp, params_argnums=())(z))
    assert "f16[16,16]" in str(jax.make_jaxpr(placed)(z))
    grads = eqx.filter_grad(lambda m: m(z) ** 2)(placed)
    ref = eqx.filter_grad(lambda m: jaxamp.autocast(m, amp, params_argnums=())(z) ** 2)(net)
    for a, b in zip(jax.tree_util.tree_leaves(grads.module), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(a, b)
    moved = eqx.apply_updates(placed, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))
    assert isinstance(moved, type(placed)) and float(moved(z) ** 2) < float(placed(z) ** 2)


SIBLINGS = {  # jaxamp's form and JAX's of each sibling, on a module and on its unbound __call__
    "jacfwd": lambda d, net, z: d.jacfwd(type(net).__call__, argnums=1)(net, z),
    "jacrev": lambda d, net, z: d.jacrev(type(net).__call__, argnums=1)(net, z),
    "hessian": lambda d, net, z: d.hessian(net)(z),
    "jvp": lambda d, net, z: d.jvp(net, (z,), (jnp.ones(2),))[1],
    "grad": lambda d, net, z: d.grad(net)(z),
}


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
@pytest.mark.parametrize("name", sorted(SIBLINGS))
def test_every_sibling_takes_a_module(name):
    net = eqx.nn.MLP(2, "scalar", 8, 2, activation=jax.nn.tanh, key=jax.random.PRNGKey(1))
    z, form = jnp.array([0.3, -0.4]), SIBLINGS[name]
    value, _ = jaxamp.scaled(lambda net, z: form(jaxamp, net, z))(S, net, z)
    np.testing.assert_allclose(value, form(jax, net, z), rtol=2e-5, atol=1e-6)


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
def test_value_and_grad_over_a_module_and_an_array_together():
    net, w = net_of(), jnp.float32(0.5)

    def loss(net, w, x):
        return w * _loss(net, x)

    state = jaxamp.init(loss, jaxamp.AmpConfig())(net, w, X)
    _, (g_net, g_w), _ = jaxamp.value_and_grad(loss, argnums=(0, 1))(state, net, w, X)
    their_net, their_w = eqx.filter_grad(lambda nw, x: loss(nw[0], nw[1], x))((net, w), X)  # noqa: E731
    np.testing.assert_allclose(g_w, their_w, rtol=1e-5)
    assert g_net.activation is None and jax.tree.structure(g_net) == jax.tree.structure(their_net)
