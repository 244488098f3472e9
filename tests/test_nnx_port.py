"""Flax NNX as first-class as Flax linen: the port of an NNX PINN trained with JAX's own
transforms on the module (examples/nnx_user), and the library behaviour it rests on: an
``nnx.Module`` passed directly or through ``nnx.split`` / ``nnx.merge``.

Oracles: JAX's own derivatives of the module in float32, to rounding; ``jax.value_and_grad``
of the module (module-shaped gradients); fp32.py itself for the port with AMP off. Tiny sizes,
few steps.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from tests.helpers.port_diff import added_lines

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nnx_user"
SMALL = ["--points", "32"]
X = jnp.linspace(0.05, 0.95, 7)


class Net(nnx.Module):
    def __init__(self, seed=0, width=16):
        rngs = nnx.Rngs(seed)
        self.body = nnx.Sequential(nnx.Linear(1, width, rngs=rngs), jnp.tanh, nnx.Linear(width, width, rngs=rngs),
                                   jnp.tanh, nnx.Linear(width, 1, rngs=rngs))

    def __call__(self, x):
        return self.body(jnp.reshape(x, (1,)))[0]


def test_the_port_changes_at_most_9_lines_no_lambda_autocast_once():
    fp32, fp16 = ((EXAMPLE / f).read_text().split('"""', 2)[2] for f in ("fp32.py", "fp16.py"))  # the code
    assert "jaxamp" not in fp32
    for idiom in ("jax.grad(jax.grad(model))", "jax.value_and_grad(loss_fn)(model", "@jax.jit", "nnx.Module"):
        assert idiom in fp32, idiom
    assert "jax.grad(" not in fp16 and "jax.value_and_grad" not in fp16 and fp16.count("autocast(") == 1
    for banned in ("lambda", "nnx.split", "nnx.merge", "params_argnums"):
        assert banned not in fp16, banned
    added = added_lines(EXAMPLE / "fp32.py", EXAMPLE / "fp16.py")
    assert 1 <= len(added) <= 9 and all(len(line) <= 100 for line in added), "\n".join(added)


@pytest.mark.slow  # trains the port end to end: the behaviour it rests on is tested fast here
def test_the_port_trains():
    from examples.nnx_user import fp16

    losses = np.array(fp16.main(["--steps", "100"] + SMALL)["losses"])
    assert np.isfinite(losses).all() and losses[-10:].mean() < 0.5 * losses[:10].mean(), losses


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
def test_the_port_with_amp_off_is_fp32(monkeypatch):
    from examples.nnx_user import fp16, fp32

    monkeypatch.setattr(fp16, "amp", jaxamp.AmpConfig(enabled=False))
    ours, theirs = fp16.main(["--steps", "30"] + SMALL), fp32.main(["--steps", "30"] + SMALL)
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-5)


@pytest.mark.slow  # fast-suite budget: the port tests run this path fast
def test_grad_of_a_module_and_of_a_merged_one_equal_jax_grad_in_float32():
    model = Net()
    graphdef, params = nnx.split(model)

    def u_net(params, x):
        return nnx.merge(graphdef, params)(x)

    theirs = jax.vmap(jax.grad(jax.grad(model)))(X)
    direct = jax.vmap(jaxamp.grad(jaxamp.grad(model)))(X)
    merged = jax.vmap(jaxamp.grad(jaxamp.grad(u_net, argnums=1), argnums=1), (None, 0))(params, X)
    np.testing.assert_allclose(direct, theirs, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(merged, theirs, rtol=2e-5, atol=1e-6)
    loss = lambda model, x: jnp.sum(jax.vmap(jaxamp.grad(jaxamp.grad(model)))(x))  # noqa: E731
    value, found = jax.jit(jaxamp.scaled(loss))({"1": 1.0, "2": 2.0**-3}, model, X)
    np.testing.assert_allclose(value, jnp.sum(theirs), rtol=2e-5, atol=1e-5)
    assert not any(bool(v) for v in found.values()), found


def _loss(model, x):
    return jnp.mean(jax.vmap(jaxamp.grad(jaxamp.grad(model)))(x) ** 2) + model(0.0) ** 2


@pytest.mark.slow  # the fast suite's budget: test_the_port_trains runs the same path
def test_value_and_grad_of_a_module_is_module_shaped_and_trains_with_the_optimizer():
    model, amp = Net(), jaxamp.AmpConfig()
    state = jaxamp.init(_loss, amp)(model, X)
    loss, grads, _ = jaxamp.value_and_grad(_loss)(state, model, X)
    their_loss, theirs = jax.value_and_grad(_loss)(model, X)
    assert isinstance(grads, Net) and jax.tree.structure(grads) == jax.tree.structure(theirs)
    np.testing.assert_allclose(loss, their_loss, rtol=1e-6)
    for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(g, t, rtol=1e-4, atol=1e-6)

    optim = jaxamp.optimizer(optax.adam(1e-2), amp_state=state)
    opt_state = optim.init(model)

    @jax.jit
    def step(model, opt_state):
        loss, grads, flags = jaxamp.value_and_grad(_loss)(opt_state, model, X)
        updates, opt_state = optim.update(grads, opt_state, model, flags=flags)
        return optax.apply_updates(model, updates), opt_state, loss

    first = None
    for _ in range(5):
        model, opt_state, loss = step(model, opt_state)
        first = float(loss) if first is None else first
    assert isinstance(model, Net) and np.isfinite(float(loss)) and float(loss) < first


def test_autocast_of_a_module_needs_no_params_argnums_and_sees_in_place_updates():
    model, amp = Net(), jaxamp.AmpConfig()
    ours, explicit = jaxamp.autocast(model, amp), jaxamp.autocast(model, amp, params_argnums=())
    assert float(ours(0.3)) == float(explicit(0.3)) and abs(float(ours(0.3)) - float(model(0.3))) < 1e-2
    assert "f16[16,16]" in str(jax.make_jaxpr(ours)(0.3))  # the hidden layer in float16
    model.body.layers[-1].bias[...] = model.body.layers[-1].bias[...] + 1.0  # nnx.update-style, in place
    assert abs(float(ours(0.3)) - float(model(0.3))) < 1e-2  # not the cached program of the old values


def test_autocast_of_a_module_is_a_module_holding_its_variables_that_trains():
    """Code that takes "a module" trains the placed network: ``autocast(model)`` is an
    ``nnx.Module`` whose parameters are the model's (under ``.module``), ``nnx.grad`` of it gives
    them gradients, and an update through it moves the model itself."""
    model, amp = Net(), jaxamp.AmpConfig()
    placed = jaxamp.autocast(model, amp)
    assert isinstance(placed, nnx.Module) and placed.module is model
    ours, own = (jax.tree_util.tree_leaves(nnx.state(m, nnx.Param)) for m in (placed, model))
    assert len(ours) == len(own) and all(bool(jnp.array_equal(a, b)) for a, b in zip(ours, own))
    assert float(placed(0.3)) == float(jaxamp.autocast(model, amp, params_argnums=())(0.3))
    grads = nnx.grad(lambda m: m(0.3) ** 2)(placed)
    before = float(placed(0.3) ** 2)
    nnx.update(placed, jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, nnx.state(placed, nnx.Param), grads))
    assert float(model(0.3) ** 2) < before  # the model itself moved


def test_nnx_optimizer_takes_the_flags_and_without_them_is_an_error_before_any_update():
    """nnx.Optimizer.update passes its keyword arguments to the transformation: ``flags=flags``
    steps it; without them (jaxamp's gradients are plain, nnx would take them) an error naming
    jaxamp.value_and_grad before any update, not a step that could never be skipped."""
    model, amp = Net(), jaxamp.AmpConfig()
    state = jaxamp.init(_loss, amp, from_profile=False)(model, X)
    optimizer = nnx.Optimizer(model, jaxamp.optimizer(optax.adam(1e-3), amp_state=state), wrt=nnx.Param)
    _, grads, flags = jaxamp.value_and_grad(_loss)(optimizer.opt_state, model, X)
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    with pytest.raises(TypeError, match=r"without `flags` while a scaler acts.*jaxamp.value_and_grad"):
        optimizer.update(model, grads)
    for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    optimizer.update(model, grads, flags=flags)
    assert int(optimizer.opt_state.skip_reason[...]) == 0
    assert any(not np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param))))
