"""The optax recipes PINN training uses, each through :func:`jaxamp.optimizer`: a chain with a
stateful transformation, a schedule, ``reduce_on_plateau``, ``MultiSteps``, Adam then L-BFGS
(its line search's ``value_fn`` scaled), and the misuses that would be silent (plain gradients,
the wrapper nested inside a stateful transformation). On a skipped step the parameters and the
whole inner state are bit for bit the old ones. Faults are injected through the batch with
jaxamp's check marks (as tests/test_optax_compose.py does), not provoked by float16 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

from tests.helpers.injected import AMP, N, PARAMS, amp_state, inject, poison_grad  # noqa: F401


def loss(params, b):
    inject(b["overflow"], 2)
    inject(jnp.bool_(False), 1)
    return jnp.mean((params["w"] * b["x"] - 1.0) ** 2)


def batch(overflow=False):
    return {"x": jnp.linspace(0.1, 1.0, N), "overflow": jnp.asarray(overflow)}


def same(a, b):
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def make_step(tx, **extra_of):
    """The user's step: ``extra_of`` maps an extra argument's name to ``f(loss, grads, params, b)``."""

    @jax.jit
    def step(params, opt_state, b):
        value, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        extra = {k: f(value, grads, params, b) for k, f in extra_of.items()}
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags, **extra)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def run(tx, overflow_at, steps=8, **extra_of):
    """Steps with an injected derivative overflow at the steps in ``overflow_at``; the states seen."""
    step, params, opt_state = make_step(tx, **extra_of), PARAMS, tx.init(PARAMS)
    seen = [(params, opt_state)]
    for i in range(steps):
        params, opt_state, _ = step(params, opt_state, batch(overflow=i in overflow_at))
        seen.append((params, opt_state))
    return seen


def assert_skips_leave_everything(seen, overflow_at):
    for i in overflow_at:
        (p0, s0), (p1, s1) = seen[i], seen[i + 1]
        assert int(s1.skip_reason) == int(jaxamp.SkipReason.DERIVATIVE_OVERFLOW)
        assert same(p0, p1), f"step {i}: parameters moved on a skip"
        assert same(s0.inner, s1.inner), f"step {i}: the inner state moved on a skip"
    for i in sorted(set(range(len(seen) - 1)) - set(overflow_at)):
        assert int(seen[i + 1][1].skip_reason) == 0 and not same(seen[i][0], seen[i + 1][0])


SKIPS = (2, 3, 6)


def test_a_chain_with_a_stateful_transformation_inside_counts_applied_steps_only():
    tx = jaxamp.optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), amp_state=amp_state())
    seen = run(tx, SKIPS)
    assert_skips_leave_everything(seen, SKIPS)
    adam = seen[-1][1].inner[1][0]
    assert int(adam.count) == 8 - len(SKIPS)


def test_a_schedule_counts_applied_steps():
    """A skipped step is not a step: ``inject_hyperparams`` (and every schedule inside the wrapper)
    reads a count that the skipped steps did not advance."""
    schedule = optax.exponential_decay(1e-2, transition_steps=1, decay_rate=0.5)
    tx = jaxamp.optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=schedule), amp_state=amp_state())
    seen = run(tx, SKIPS)
    assert_skips_leave_everything(seen, SKIPS)
    state = seen[-1][1].inner
    applied = 8 - len(SKIPS)
    assert int(state.count) == applied
    np.testing.assert_allclose(float(state.hyperparams["learning_rate"]), 1e-2 * 0.5 ** (applied - 1), rtol=1e-6)


def test_reduce_on_plateau_is_never_fed_a_skipped_steps_loss():
    plateau = optax.contrib.reduce_on_plateau(patience=2, cooldown=0, factor=0.5, accumulation_size=1)
    tx = jaxamp.optimizer(optax.chain(optax.adam(1e-2), plateau), amp_state=amp_state())
    # the loss a user would pass: NaN on skipped steps would halve the scale after `patience` of them
    value = lambda v, g, p, b: jnp.where(b["overflow"], jnp.nan, v)  # noqa: E731
    seen = run(tx, (1, 2, 3, 4, 5), steps=8, value=value)
    assert_skips_leave_everything(seen, (1, 2, 3, 4, 5))
    plateau_state = seen[-1][1].inner[1]
    assert float(plateau_state.scale) == 1.0 and int(plateau_state.plateau_count) == 0
    assert np.isfinite(float(plateau_state.best_value)) and np.isfinite(float(plateau_state.avg_value))


def test_multisteps_inside_accumulates_applied_micro_steps_only():
    tx = jaxamp.optimizer(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), amp_state=amp_state())
    seen = run(tx, (1,), steps=4)
    (_, before), (_, after) = seen[1], seen[2]
    assert same(before.inner, after.inner)  # the skipped micro-step's gradient was not accumulated
    counts = [int(s.inner.gradient_step) for _, s in seen]
    assert counts == [0, 0, 0, 1, 1]  # micro steps 0, 2 make one update; 3 waits for its pair


@pytest.mark.parametrize("outer", ["chain", "multisteps"])
def test_the_wrapper_inside_a_stateful_transformation_is_refused_with_the_fix(outer):
    inner = jaxamp.optimizer(optax.sgd(0.1), amp_state=amp_state())
    tx = {"chain": optax.chain(inner, optax.scale_by_adam()),
          "multisteps": optax.MultiSteps(inner, every_k_schedule=2)}[outer]
    with pytest.raises(TypeError, match=r"wrap the whole optimizer.*jaxamp.optimizer\(optax.chain\(a, b\)\)"):
        jaxamp.value_and_grad(loss)(tx.init(PARAMS), PARAMS, batch())


def test_a_stateless_transformation_before_the_wrapper_is_allowed():
    tx = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state()))
    opt_state = tx.init(PARAMS)
    params, after, _ = make_step(tx)(PARAMS, opt_state, batch(overflow=True))
    assert int(after[1].skip_reason) == int(jaxamp.SkipReason.DERIVATIVE_OVERFLOW)
    assert same(params, PARAMS) and same(after[1].inner, opt_state[1].inner)


def test_plain_gradients_while_a_scaler_acts_are_an_error_naming_value_and_grad():
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state())
    opt_state = tx.init(PARAMS)
    grads = jax.grad(loss)(PARAMS, batch())
    with pytest.raises(TypeError, match=r"without `flags`.*jaxamp.value_and_grad\(loss\)\(opt_state.*flags=flags"):
        tx.update(grads, opt_state, PARAMS)


def test_plain_gradients_are_fine_where_no_scaler_acts():
    for amp in (jaxamp.AmpConfig(dtype="bfloat16"), jaxamp.AmpConfig(enabled=False)):
        tx = jaxamp.optimizer(optax.sgd(0.1), amp_state=jaxamp.init(None, amp)())
        opt_state = tx.init(PARAMS)
        updates, _ = tx.update(jax.grad(loss)(PARAMS, batch()), opt_state, PARAMS)
        assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree_util.tree_leaves(updates))


def lbfgs_run(amp, steps):
    """Adam for some steps, then L-BFGS with its line search's value_fn (a user's one-liner)."""
    state = jaxamp.init(loss, amp)(PARAMS, batch())
    adam, lbfgs = (jaxamp.optimizer(optax.adam(1e-2), amp_state=state),
                   jaxamp.optimizer(optax.lbfgs(), amp_state=state))
    params, opt_state = PARAMS, adam.init(PARAMS)
    step = make_step(adam)
    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state, batch())
    b = batch()
    after_adam = float(loss(params, b))
    lb_state = jaxamp._src.training.optim.with_amp_state(lbfgs.init(params), opt_state.amp)
    lb_step = make_step(lbfgs, value=lambda v, g, p, b: v, grad=lambda v, g, p, b: g,
                        value_fn=lambda v, g, p, b: (lambda q: loss(q, b)))
    for _ in range(steps):
        params, lb_state, value = lb_step(params, lb_state, b)
    return float(loss(params, b)), after_adam, lb_state


@pytest.mark.slow
def test_adam_then_lbfgs_trains_as_float32_does():
    fp16, adam16, state = lbfgs_run(AMP, 20)
    fp32, _, _ = lbfgs_run(jaxamp.AmpConfig(enabled=False), 20)
    assert int(state.consecutive_skips) == 0
    assert fp16 < 1e-2 * adam16 and fp16 <= 1.2 * fp32 + 1e-6, (fp16, adam16, fp32)


def test_the_line_search_value_fn_runs_under_the_scales_and_an_overflow_is_inf():
    state = amp_state()
    value_fn = jaxamp._src.training.optim.scaled_value_fn(lambda p: loss(p, batch(overflow=True)), state)
    assert float(value_fn(PARAMS)) == float("inf")
    value_fn = jaxamp._src.training.optim.scaled_value_fn(lambda p: loss(p, batch()), state)
    np.testing.assert_allclose(float(value_fn(PARAMS)), float(loss(PARAMS, batch())), rtol=1e-6)


def losses(params, b):
    inject(b["overflow"], 2)
    pde = poison_grad(jnp.mean((params["w"] * b["x"] - 1.0) ** 2), b["nan_grad"])
    return {"pde": pde, "bc": (params["w"][0] - 2.0) ** 2}


def test_gradient_norm_loss_weights_never_go_nan_or_inf():
    """jaxpi-style weights ``w_i = sum_j |g_j| / |g_i|`` from :func:`jaxamp.grad_norms`: a term whose
    derivative overflows, or whose gradients are non-finite, gives ``ok`` False and finite norms;
    the weights keep their old values on those steps and on the others equal float32's formula."""
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state())
    norms_of = jax.jit(jaxamp.grad_norms(losses))
    weights, opt_state = {"pde": jnp.float32(1.0), "bc": jnp.float32(1.0)}, tx.init(PARAMS)
    for overflow, nan_grad in ((False, False), (True, False), (False, True), (False, False)):
        b = {**batch(overflow), "nan_grad": jnp.asarray(nan_grad)}
        norms, ok = norms_of(opt_state, PARAMS, b)
        assert all(np.isfinite(float(v)) and float(v) > 0 for v in norms.values())
        assert bool(ok) == (not overflow and not nan_grad)
        total = sum(norms.values())
        new = {k: total / v for k, v in norms.items()}
        weights = {k: jnp.where(ok, new[k], weights[k]) for k in weights}
        assert all(np.isfinite(float(v)) for v in weights.values())
        if bool(ok):
            ref = {k: float(optax.tree.norm(jax.grad(lambda p: losses(p, b)[k])(PARAMS))) for k in norms}
            for k in ref:
                np.testing.assert_allclose(float(norms[k]), ref[k], rtol=1e-5)


def test_a_stall_on_plain_float16_with_a_non_finite_loss_names_derivative_scaling():
    """A non-finite loss with no derivative scaler flagged (under plain fp16 a float16 derivative of
    the network overflowing, or a term of the loss itself): bad values, which no loss scale cures,
    so the loss scale stays where it is; the report names derivative scaling and only arguments
    that exist. Non-finite weight gradients under a finite loss with the loss scale at its floor
    say the same (explain)."""
    plain = jaxamp.AmpConfig(dtype="float16", derivative_scaling=False, loss_scaler={"init_scale": 2.0**8})
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=jaxamp.init(None, plain)(), max_consecutive_skips=40)

    def bad_loss(params, b):
        return jnp.mean((params["w"] * b["x"]) ** 2) * jnp.inf

    @jax.jit
    def step(params, opt_state, b):
        _, grads, flags = jaxamp.value_and_grad(bad_loss)(opt_state, params, b)
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = PARAMS, tx.init(PARAMS)
    with pytest.warns(jaxamp.StallWarning) as record:
        for _ in range(40):
            params, opt_state = step(params, opt_state, batch())
        jax.block_until_ready(params)
    line = str(record[0].message)
    assert "bad values" in line and "derivative_scaling=True" in line and "compute them in float32" in line
    assert "grad_clip_max_norm)" not in line and "lower the learning rate" not in line
    assert int(opt_state.skip_reason) == jaxamp.SkipReason.NONFINITE_VALUES
    assert float(opt_state.amp.loss_scale) == 2.0**8  # no loss scale cures a non-finite forward value
    cause, advice = jaxamp._src.training.monitor.explain(int(jaxamp.SkipReason.NONFINITE_GRADS), [],
                                                         loss_scale_log2=-30.0)
    assert "loss scale already at 2**" in cause and "derivative_scaling=True" in advice
    # with derivative keys present the advice does not ask for them
    cause, advice = jaxamp._src.training.monitor.explain(
        int(jaxamp.SkipReason.NONFINITE_GRADS), [], loss_scale_log2=-30.0, derivative_keys=("2",))
    assert "derivative_scaling" not in advice and "non-dimensionalize" in advice
    cause, advice = jaxamp._src.training.monitor.explain(int(jaxamp.SkipReason.NONFINITE_GRADS), [],
                                                         loss_scale_log2=4.0)
    assert "optax.clip_by_global_norm inside jaxamp.optimizer" in advice


def test_a_librarys_own_loop_gets_scaled_gradients_from_loss_given_to_the_optimizer():
    """A loop that computes plain gradients and passes extra arguments to ``update`` (as jinns's
    ``solve`` does with ``extra_optax_args_and_kwargs``): ``jaxamp.optimizer(inner, loss=...)``
    recomputes them through :func:`jaxamp.value_and_grad`; the steps equal the user-step form."""
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state(), loss=lambda p, batch: loss(p, batch))

    @jax.jit
    def library_step(params, opt_state, b):  # the library's code, unchanged
        grads = jax.grad(loss)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params, batch=b)
        return optax.apply_updates(params, updates), opt_state

    ref = run(jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state()), SKIPS)
    params, opt_state = PARAMS, tx.init(PARAMS)
    for i in range(8):
        params, opt_state = library_step(params, opt_state, batch(overflow=i in SKIPS))
        assert same(params, ref[i + 1][0]) and same(opt_state, ref[i + 1][1])
    with pytest.raises(TypeError, match="drop one of them"):
        tx.update(jax.grad(loss)(PARAMS, batch()), tx.init(PARAMS), PARAMS, batch=batch(), flags={})


def test_containers_that_are_not_optax_states_are_looked_through():
    """A train state holding the optimizer state beside its own arrays (a Flax TrainState, an
    ``nnx.Optimizer``, a dict) is not a transformation: the wrapper's state inside it is found."""
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state())
    holder = {"step": jnp.int32(3), "params": PARAMS, "opt_state": tx.init(PARAMS)}
    _, _, flags = jaxamp.value_and_grad(loss)(holder, PARAMS, batch(overflow=True))
    assert bool(flags.found_inf["2"]) and flags.source == "optimizer"


def test_the_optimizer_state_round_trips_through_pickle_deepcopy_and_flax():
    """The optimizer's state (inner state, AMP state, skip reason and count) after steps with skips:
    pickle, ``copy.deepcopy`` and ``flax.serialization`` give it back bit for bit, and a restored
    state steps exactly as the original."""
    import copy
    import pickle

    from flax import serialization

    tx = jaxamp.optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), amp_state=amp_state())
    params, state = run(tx, SKIPS, steps=4)[-1]
    restored = [pickle.loads(pickle.dumps(state)), copy.deepcopy(state),
                serialization.from_bytes(tx.init(PARAMS), serialization.to_bytes(state))]
    step = make_step(tx)
    want = step(params, state, batch())
    for other in restored:
        assert same(other, state) and type(other.amp) is type(state.amp) and other.amp.amp == state.amp.amp
        got = step(params, other, batch())
        assert same(got[0], want[0]) and same(got[1], want[1])


def test_apply_or_skip_refuses_value_and_grads_flags_without_their_gradients():
    state = amp_state()
    _, grads, flags = jaxamp.value_and_grad(loss)(state, PARAMS, batch())
    with pytest.raises(TypeError, match=r"`grads` is None beside the StepFlags"):
        jaxamp.apply_or_skip(state, None, flags, PARAMS, PARAMS)
    kept, _ = jaxamp.apply_or_skip(state, grads, flags, PARAMS, PARAMS)
    assert same(kept, PARAMS)
