"""jaxamp.optimizer as an optax citizen: outermost or after a stateless clip in optax.chain, under
pmean/psum of the gradients (the flags OR-ed by its ``axis_name``), built before the loss, and the
misuses around it (a stale state, gradients without their flags, its state nested in a stateful
transformation, apply_or_skip's trees); jaxamp's gradients are plain, any optax optimizer takes
them. Faults are injected through the batch with jaxamp's check marks (as tests/test_train_step.py
does), not provoked by float16 rounding."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp

from tests.helpers.injected import AMP, N, PARAMS, amp_state, inject, poison_grad  # noqa: F401


def loss(params, b):
    out = poison_grad(jnp.mean((params["w"] * b["x"] - 1.0) ** 2), b["nan_grad"])
    inject(b["overflow"], 2)
    inject(jnp.bool_(False), 1)
    return out


def batch(overflow=False, nan_grad=False, scale=1.0):
    return {"x": scale * jnp.linspace(0.0, 1.0, N), "overflow": jnp.asarray(overflow),
            "nan_grad": jnp.asarray(nan_grad)}


def chains():
    clip = optax.clip_by_global_norm(0.1)  # below the gradients' norm: it acts
    return {"clip_then_amp": optax.chain(clip, jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state())),
            "amp_of_chain": jaxamp.optimizer(optax.chain(clip, optax.adam(1e-2)), amp_state=amp_state())}


def same(a, b):
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def make_step(tx):
    @jax.jit
    def step(params, opt_state, b):
        value, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags)
        return optax.apply_updates(params, updates), opt_state, value

    return step


@pytest.mark.parametrize("name", ["clip_then_amp", "amp_of_chain"])
def test_both_chain_forms_train_and_skip_bit_identically(name):
    tx = chains()[name]
    step, params, opt_state = make_step(tx), PARAMS, tx.init(PARAMS)
    first = None
    for _ in range(5):
        params, opt_state, value = step(params, opt_state, batch())
        first = float(value) if first is None else first
    assert float(value) < first
    amp = jaxamp._src.training.step.find_opt_state(opt_state)
    assert int(amp.skip_reason) == 0 and int(amp.consecutive_skips) == 0
    for flags, reason in (dict(overflow=True), jaxamp.SkipReason.DERIVATIVE_OVERFLOW), \
                         (dict(nan_grad=True), jaxamp.SkipReason.NONFINITE_GRADS):
        new_params, new_state, _ = step(params, opt_state, batch(**flags))
        new = jaxamp._src.training.step.find_opt_state(new_state)
        assert same(new_params, params) and same(new.inner, amp.inner)
        assert int(new.skip_reason) == reason and int(new.consecutive_skips) == 1
        # the flags reach jaxamp.optimizer past the clip, naming the one key that overflowed (or none)
        halved = {k: float(new.amp.scales[k]) / float(amp.amp.scales[k]) for k in ("1", "2")}
        loss_ratio = float(new.amp.loss_scale) / float(amp.amp.loss_scale)
        if reason == jaxamp.SkipReason.DERIVATIVE_OVERFLOW:
            assert halved == {"1": 1.0, "2": 0.5} and loss_ratio == 1.0
        else:
            assert halved == {"1": 1.0, "2": 1.0} and loss_ratio == 0.5


def test_a_skipped_update_leaves_signed_zero_parameters_bit_for_bit_under_apply_updates():
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state())
    params = {"w": jnp.where(jnp.arange(N) % 2 == 0, -0.0, 0.0).astype(jnp.float32)}
    new_params, new_state, _ = make_step(tx)(params, tx.init(params), batch(overflow=True))
    assert int(new_state.skip_reason) == jaxamp.SkipReason.DERIVATIVE_OVERFLOW
    bits = lambda t: jax.device_get(t["w"]).view("uint32")  # noqa: E731
    assert (bits(new_params) == bits(params)).all()


def test_a_clean_step_is_clipped_as_the_bare_gradients_would_be():
    tx = chains()["clip_then_amp"]
    opt_state = tx.init(PARAMS)
    _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, PARAMS, batch())
    updates, _ = tx.update(grads, opt_state, PARAMS, flags=flags)
    ref = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    ref_updates, _ = ref.update(grads, ref.init(PARAMS), PARAMS)
    assert same(updates, ref_updates)


@pytest.mark.parametrize("reduce", ["pmean", "psum"])
def test_flags_of_reduced_gradients_are_a_global_or(reduce):
    """Two replicas under jax.vmap(axis_name=...): the gradients pmean-ed or psum-ed before the
    optimizer, the flags OR-ed by its ``axis_name``; an overflow on one replica skips both and
    halves key "2" only. Without ``axis_name`` each replica decides on its own flags."""

    def run(axis_name):
        tx = optax.chain(optax.clip_by_global_norm(0.1),
                         jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state(), axis_name=axis_name))

        def replica(params, opt_state, b):
            _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
            grads = getattr(jax.lax, reduce)(grads, "d")
            updates, opt_state = tx.update(grads, opt_state, params, flags=flags)
            return optax.apply_updates(params, updates), opt_state

        two = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), batch(), batch(overflow=True, scale=2.0))
        params, new_state = jax.jit(jax.vmap(replica, in_axes=(None, None, 0),
                                             axis_name="d"))(PARAMS, tx.init(PARAMS), two)
        return params, jaxamp._src.training.step.find_opt_state(new_state)

    params, new = run("d")
    assert new.skip_reason.tolist() == [1, 1] and new.amp.scales["2"].tolist() == [0.5, 0.5]
    assert new.amp.scales["1"].tolist() == [1.0, 1.0]
    for leaf, before in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(PARAMS)):
        assert bool(jnp.array_equal(leaf[0], before)) and bool(jnp.array_equal(leaf[1], before))
    _, alone = run(None)
    assert alone.skip_reason.tolist() == [0, 1] and alone.amp.scales["2"].tolist() == [1.0, 0.5]


PMAP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, optax, numpy as np, jaxamp
    from tests.test_optax_compose import PARAMS, amp_state, batch, loss
    assert jax.device_count() == 2
    tx = optax.chain(optax.clip_by_global_norm(0.1),
                     jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state(), axis_name="i"))
    def step(params, opt_state, b):
        _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        updates, opt_state = tx.update(jax.lax.pmean(grads, "i"), opt_state, params, flags=flags)
        return optax.apply_updates(params, updates), opt_state
    rep = lambda t: jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), t)
    two = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), batch(), batch(overflow=True))
    params, st = jax.pmap(step, axis_name="i")(rep(PARAMS), rep(tx.init(PARAMS)), two)
    new = jaxamp._src.training.step.find_opt_state(st)
    assert new.skip_reason.tolist() == [1, 1] and new.amp.scales["2"].tolist() == [0.5, 0.5], new
    assert np.array_equal(np.asarray(params["w"][1]), np.asarray(PARAMS["w"]))
    # jit over a batch sharded on a 2-device mesh: the flags are the whole batch's (no axis_name)
    tx = optax.chain(optax.clip_by_global_norm(0.1), jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state()))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    b = jax.device_put(dict(batch(), overflow=jnp.asarray(True)), {"x": shard, "overflow": None, "nan_grad": None})
    opt_state = tx.init(PARAMS)
    @jax.jit
    def jstep(params, opt_state, b):
        _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags)
        return optax.apply_updates(params, updates), opt_state
    p2, st2 = jstep(PARAMS, opt_state, b)
    assert int(jaxamp._src.training.step.find_opt_state(st2).skip_reason) == 1 and np.array_equal(p2["w"], PARAMS["w"])
    p3, st3 = jstep(PARAMS, opt_state, jax.device_put(batch(), {"x": shard, "overflow": None, "nan_grad": None}))
    assert (int(jaxamp._src.training.step.find_opt_state(st3).skip_reason) == 0
            and not np.array_equal(p3["w"], PARAMS["w"]))
    print("ok")
""")


@pytest.mark.slow  # fast-suite budget: pmean/psum under vmap run fast
def test_pmap_with_pmean_and_jit_over_a_sharded_batch():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", PMAP_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_an_optimizer_built_before_the_loss_takes_its_state_later():
    tx = jaxamp.optimizer(optax.adam(1e-2))  # no AMP state yet
    later = jaxamp._src.training.optim.with_amp_state(tx.init(PARAMS), amp_state())
    assert sorted(later.amp.scales) == ["1", "2"]
    chained = optax.chain(optax.clip_by_global_norm(1.0), tx)
    bare = chained.init(PARAMS)
    with pytest.raises(TypeError, match=r"no AmpState yet.*jaxamp._src.training.optim.with_amp_state\(opt_state"):
        jaxamp.value_and_grad(loss)(bare, PARAMS, batch())
    opt_state = jaxamp._src.training.optim.with_amp_state(bare, amp_state())
    params, opt_state, _ = make_step(chained)(PARAMS, opt_state, batch())
    assert int(jaxamp._src.training.step.find_opt_state(opt_state).skip_reason) == 0 and not same(params, PARAMS)


def test_a_stale_bare_amp_state_is_an_error_at_trace_time():
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state())
    opt_state = tx.init(PARAMS)
    _, grads, flags = jaxamp.value_and_grad(loss)(amp_state(), PARAMS, batch())  # the initial state, not opt_state
    with pytest.raises(ValueError, match=r"from a bare AmpState.*jaxamp.value_and_grad\(loss\)\(opt_state, params"):
        jax.jit(tx.update)(grads, opt_state, PARAMS, flags=flags)


def test_jaxamp_gradients_are_plain_and_the_misuses_of_the_optimizer_name_the_fix():
    state = amp_state()
    _, grads, flags = jaxamp.value_and_grad(loss)(state, PARAMS, batch())
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(PARAMS)
    adam = optax.adam(1e-2)  # any optax optimizer takes them as they are
    updates, _ = adam.update(grads, adam.init(PARAMS), PARAMS)
    assert bool(jnp.all(jnp.isfinite(optax.apply_updates(PARAMS, updates)["w"])))
    # jaxamp.optimizer given gradients without their flags (they could be unscaled): an error
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=state)
    with pytest.raises(TypeError, match=r"without `flags` while a scaler acts.*jaxamp.value_and_grad"):
        tx.update(grads, tx.init(PARAMS), PARAMS)
    # its state inside a stateful transformation's (that state would move on a skipped step)
    for nested in (optax.chain(jaxamp.optimizer(optax.sgd(1e-2), amp_state=state), optax.adam(1e-2)),
                   optax.MultiSteps(jaxamp.optimizer(optax.adam(1e-2), amp_state=state), 2)):
        with pytest.raises(TypeError, match=r"inside another transformation's state.*wrap the whole optimizer"):
            jaxamp.value_and_grad(loss)(nested.init(PARAMS), PARAMS, batch())


def test_non_finite_new_values_skip_with_their_own_reason():
    state = amp_state()
    _, grads, flags = jaxamp.value_and_grad(loss)(state, PARAMS, batch())
    weights = {"ics": jnp.float32(1.0)}
    new_weights = {"ics": jnp.float32(jnp.nan)}  # e.g. an NTK update of the loss weights gone wrong
    kept, after, reason = jaxamp.apply_or_skip(state, grads, flags, new_weights, weights, return_reason=True)
    assert float(kept["ics"]) == 1.0 and int(reason) == jaxamp.SkipReason.NONFINITE_UPDATES
    assert same(after.derivative, state.derivative) and same(after.loss, state.loss)  # no scaler moves
    tx = jaxamp.optimizer(optax.sgd(jnp.float32(jnp.nan)), amp_state=amp_state())  # a NaN learning rate
    opt_state = tx.init(PARAMS)
    _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, PARAMS, batch())
    updates, new = tx.update(grads, opt_state, PARAMS, flags=flags)
    assert int(new.skip_reason) == jaxamp.SkipReason.NONFINITE_UPDATES
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree_util.tree_leaves(updates))


def test_apply_or_skip_fits_back_where_it_came_from_and_checks_its_trees():
    tx = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state()))
    opt_state = tx.init(PARAMS)
    _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, PARAMS, batch(overflow=True))
    kept, new_state = jaxamp.apply_or_skip(opt_state, grads, flags, {"w": PARAMS["w"] + 1.0}, PARAMS)
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(opt_state)
    new = jaxamp._src.training.step.find_opt_state(new_state)
    assert same(kept, PARAMS) and int(new.skip_reason) == 1 and int(new.consecutive_skips) == 1
    with pytest.raises(TypeError, match=r"`applied` and `skipped` must have the same pytree structure"):
        jaxamp.apply_or_skip(opt_state, grads, flags, {"w": PARAMS["w"]}, (PARAMS["w"],))


def test_bad_optimizer_arguments_name_the_argument_and_what_is_allowed():
    for kwargs, fragment in ((dict(max_consecutive_skips=0), "`max_consecutive_skips`=0 is not allowed"),
                             (dict(max_consecutive_skips=True), "`max_consecutive_skips`=True is not allowed"),
                             (dict(on_stall="stop"), "`on_stall`='stop' is not allowed: expected one of")):
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            jaxamp.optimizer(optax.adam(1e-3), **kwargs)
    with pytest.raises(TypeError, match="`amp_state`=.*must be a jaxamp.AmpState"):
        jaxamp.optimizer(optax.adam(1e-3), amp_state={"scales": {}})
