"""The optax recipes of docs/optax_recipes.md on a physical-units PINN where plain float16 dies
(tests/helpers/physical.py: 1-D Poisson on a 2 mm rod, a plain-JAX MLP under
``jaxamp.autocast`` with its first layer in float16, ``u''`` by the user's ``jax.hessian``).

Each recipe runs a few steps with a derivative overflow injected on chosen steps (through
jaxamp's own check marks): it trains, a skipped step leaves the parameters and every inner state
bit for bit, a schedule or ``reduce_on_plateau`` never sees a skipped step, a loss weight is never
NaN or inf. The fast part is a small net (width 8) on 16 points and a few steps; the runs that
measure (plain fp16 against fp32 over 300 steps, Adam then L-BFGS within 1.2x fp32's error over
3 seeds, Gauss-Newton) are ``slow``.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

from tests.helpers import physical as P
from tests.helpers import physical_runs as R
from tests.helpers.gauss_newton import gauss_newton, gauss_newton_step

WIDTH, N = 8, 16
SKIPS = (2, 5)


def same(a, b):
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def start(amp=P.FEW_STEPS, seed=0, width=WIDTH, n=N, fp32_boundary=False):
    """The problem's loss, its parameters and the AMP state started from a float32 profile."""
    u, residuals, losses, loss = P.problem(amp, fp32_boundary=fp32_boundary)
    params = P.init_params(seed, width=width)
    return (u, residuals, losses, loss), params, jaxamp.init(loss, amp)(params, P.batch(n))


def make_step(loss, tx, **extra_of):
    """The user's step; ``extra_of`` maps an extra argument of ``update`` to ``f(value, flags, batch)``."""

    @jax.jit
    def step(params, opt_state, b):
        value, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        extra = {k: f(value, flags, b) for k, f in extra_of.items()}
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags, **extra)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def run(step, params, opt_state, steps, skips=SKIPS, n=N):
    """``steps`` steps on a fixed batch, a derivative overflow injected at ``skips``; the states seen."""
    seen = [(params, opt_state, None)]
    for i in range(steps):
        params, opt_state, value = step(params, opt_state, P.batch(n, overflow=i in skips))
        seen.append((params, opt_state, value))
    return seen


def assert_skips_keep_everything(seen, skips=SKIPS):
    """Injected steps skip as DERIVATIVE_OVERFLOW; every skipped step (injected or the loss
    scaler's) leaves the parameters and the whole inner state bit for bit; applied steps move."""
    applied = 0
    for i in range(len(seen) - 1):
        (p0, s0, _), (p1, s1, _) = seen[i], seen[i + 1]
        reason = int(s1.skip_reason)
        if i in skips:
            assert reason == int(jaxamp.SkipReason.DERIVATIVE_OVERFLOW), (i, reason)
        if reason:
            assert same(p0, p1), f"step {i}: parameters moved on a skip"
            assert same(s0.inner, s1.inner), f"step {i}: the inner state moved on a skip"
        else:
            applied += 1
            assert not same(p0, p1), f"step {i}: an applied step left the parameters"
    return applied


LOSS32 = P.problem(P.FP32)[3]


def loss_at(params, n=N):
    """The loss of ``params`` in float32 (the float16 loss outside ``jaxamp.scaled`` would overflow)."""
    return float(LOSS32(params, P.batch(n)))


@pytest.mark.slow  # a clip + adam chain trained to its skipped steps: the schedule test below runs fast
def test_a_stateful_chain_inside_the_wrapper_counts_applied_steps_only():
    (_, _, _, loss), params, state = start()
    tx = jaxamp.optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), amp_state=state)
    seen = run(make_step(loss, tx), params, tx.init(params), 8)
    applied = assert_skips_keep_everything(seen)
    assert int(seen[-1][1].inner[1][0].count) == applied >= 8 - len(SKIPS) - 1
    assert loss_at(seen[-1][0]) < loss_at(params)


def test_a_schedule_counts_applied_steps():
    (_, _, _, loss), params, state = start()
    schedule = optax.exponential_decay(1e-2, transition_steps=1, decay_rate=0.8)
    tx = jaxamp.optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=schedule), amp_state=state)
    seen = run(make_step(loss, tx), params, tx.init(params), 8)
    applied = assert_skips_keep_everything(seen)
    inner = seen[-1][1].inner
    assert int(inner.count) == applied
    np.testing.assert_allclose(float(inner.hyperparams["learning_rate"]), float(schedule(applied - 1)), rtol=1e-6)


def test_reduce_on_plateau_never_sees_a_skipped_steps_loss():
    """The loss the user passes is NaN on a flagged step (as a real overflow's would be): the
    plateau's state does not move on it, so its scale, best and average stay finite."""
    (_, _, _, loss), params, state = start()
    plateau = optax.contrib.reduce_on_plateau(patience=2, cooldown=0, factor=0.5, accumulation_size=1)
    tx = jaxamp.optimizer(optax.chain(optax.adam(1e-2), plateau), amp_state=state)
    flagged = lambda flags: jnp.any(jnp.stack([jnp.asarray(v) for v in flags.found_inf.values()]))  # noqa: E731
    step = make_step(loss, tx, value=lambda v, flags, b: jnp.where(flagged(flags), jnp.nan, v))
    skips = (1, 2, 3, 4)
    seen = run(step, params, tx.init(params), 7, skips=skips)
    applied = assert_skips_keep_everything(seen, skips)
    p = seen[-1][1].inner[1]
    assert float(p.scale) == 1.0 and int(p.plateau_count) < applied
    assert np.isfinite(float(p.best_value)) and np.isfinite(float(p.avg_value))
    assert float(p.best_value) == min(float(v) for _, s, v in seen[1:] if int(s.skip_reason) == 0)


def test_multisteps_inside_accumulates_applied_micro_steps_only():
    (_, _, _, loss), params, state = start()
    tx = jaxamp.optimizer(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), amp_state=state)
    seen = run(make_step(loss, tx), params, tx.init(params), 8, skips=(1,))
    (_, before, _), (_, after, _) = seen[1], seen[2]
    assert int(after.skip_reason) == int(jaxamp.SkipReason.DERIVATIVE_OVERFLOW) and same(before.inner, after.inner)
    mini = [int(s.inner.mini_step) for _, s, _ in seen]
    assert mini == [0, 1, 1, 0, 1, 0, 1, 0, 1], mini  # the skipped micro-step 1 is not counted
    assert int(seen[-1][1].inner.gradient_step) == 3


@pytest.mark.slow  # trains: the recipes' skips are checked fast above
def test_gradient_norm_loss_weights_stay_finite_and_train():
    """jaxpi-style weights ``w_i = sum_j |g_j| / |g_i|`` from :func:`jaxamp.grad_norms` each step:
    never NaN or inf (kept on a flagged step, ``ok`` False), equal to float32's formula within
    float16's rounding on the others; the weighted loss trains."""
    (_, _, losses, loss), params, state = start()
    (_, _, losses32, _), _, _ = start(P.FP32)
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=state)
    norms_of = jax.jit(jaxamp.grad_norms(losses))
    norms32 = jax.jit(lambda p, b: {k: optax.tree.norm(jax.grad(lambda q: losses32(q, b)[k])(p))
                                    for k in ("pde", "bc")})

    def weighted(params, b, w):
        parts = losses(params, b)
        return sum(w[k] * parts[k] for k in parts)

    @jax.jit
    def step(params, opt_state, b, w):
        value, grads, flags = jaxamp.value_and_grad(weighted)(opt_state, params, b, w)
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags)
        return optax.apply_updates(params, updates), opt_state, value

    w, opt_state, oks = {"pde": jnp.float32(1.0), "bc": jnp.float32(P.BC_WEIGHT)}, tx.init(params), []
    start_loss = loss_at(params)
    for i in range(8):
        b = P.batch(N, overflow=i in SKIPS)
        norms, ok = norms_of(opt_state, params, b)
        assert all(np.isfinite(float(v)) and float(v) > 0 for v in norms.values()), norms
        if i in SKIPS:
            assert not bool(ok)
        if bool(ok):
            ref = norms32(params, b)
            for k in ref:
                np.testing.assert_allclose(float(norms[k]), float(ref[k]), rtol=0.05)
        total = sum(norms.values())
        w = {k: jnp.where(ok, total / norms[k], w[k]) for k in w}
        assert all(np.isfinite(float(v)) and float(v) > 0 for v in w.values()), w
        oks.append(bool(ok))
        params, opt_state, _ = step(params, opt_state, b, w)
    assert sum(oks) >= 8 - len(SKIPS) - 1, oks
    assert loss_at(params) < start_loss


def make_lbfgs_step(loss, tx):
    """The L-BFGS step of docs/optax_recipes.md: ``value``, ``grad`` and the line search's
    ``value_fn`` (run by the wrapper under the state's scales) on the step's batch."""

    @jax.jit
    def step(params, opt_state, b):
        value, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, b)
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags, value=value, grad=grads,
                                       value_fn=lambda p: loss(p, b))
        return optax.apply_updates(params, updates), opt_state, value

    return step


@pytest.mark.slow  # about 10 s of compiling and line searches on 2 cores: over the fast suite's share
def test_lbfgs_in_float16_trains_and_skips():
    """L-BFGS under fp16 + DerivScaler (in the recipe it follows Adam, its AMP state carried over:
    ``jaxamp.optimizer(optax.lbfgs(), amp_state=adam_state.amp)``): the loss falls, an injected
    overflow skips with the L-BFGS memory and line-search state kept, and that state stays finite."""
    (_, _, _, loss), params, state = start()
    lbfgs = jaxamp.optimizer(optax.lbfgs(), amp_state=state)
    seen = run(make_lbfgs_step(loss, lbfgs), params, lbfgs.init(params), 6, skips=(2,))
    assert_skips_keep_everything(seen, (2,))
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(seen[-1][1].inner))
    assert loss_at(seen[-1][0]) < 0.75 * loss_at(params), (loss_at(seen[-1][0]), loss_at(params))


@pytest.mark.slow  # trains: the skip it rests on is checked fast above
def test_gauss_newton_trains_and_skips():
    """A damped Gauss-Newton step (tests/helpers/gauss_newton.py) on the residuals' Jacobian: the
    Jacobian under the derivative scales, its backward passes loss-scaled; the flags of
    ``jaxamp.scaled`` decide the step; an injected overflow skips with params and state kept."""
    (_, residuals, _, loss), params, state = start()
    tx = jaxamp.optimizer(gauss_newton(), amp_state=state)
    step = gauss_newton_step(tx, residuals, loss)

    before = loss_at(params)
    seen = run(step, params, tx.init(params), 6, skips=(2,))
    applied = assert_skips_keep_everything(seen, (2,))
    assert int(seen[-1][1].inner.count) == applied
    assert loss_at(seen[-1][0]) < 0.1 * before, (loss_at(seen[-1][0]), before)


@pytest.fixture
def highest_precision():
    with jax.default_matmul_precision("highest"):  # the fp32 baselines' matmuls in full float32
        yield


@pytest.mark.slow
def test_plain_fp16_never_trains_while_derivscaler_reaches_fp32s_error(highest_precision):
    """300 Adam steps (width 16, 32 points, seed 0, default configs): plain fp16 skips every
    step and stays at its initial error; fp16 + DerivScaler ends within 1.2x fp32's error
    (measured 0.92x, errors of the weights evaluated in float32, docs/optax_recipes.md)."""
    ref, _, _ = R.adam(P.FP32, 0, 300)
    plain, _, plain_skipped = R.adam(P.PLAIN_FP16, 0, 300)
    ours, _, skipped = R.adam(P.DERIV_SCALER, 0, 300)
    assert plain_skipped == 300 and R.error(plain) == R.error(P.init_params(0))
    assert skipped <= 15 and R.error(ours) <= 1.2 * R.error(ref), (R.error(ours), R.error(ref), skipped)


@pytest.mark.slow
def test_adam_then_lbfgs_ends_within_1_2x_fp32s_error_median_of_3_seeds(highest_precision):
    """The recipe of docs/optax_recipes.md: 300 Adam steps under fp16 + DerivScaler with the
    boundary term in float32, then 40 L-BFGS steps in float32; against 300 + 40 in fp32, errors
    of the weights evaluated in float32 (measured 0.60x, 0.38x, 0.67x)."""
    ratios = sorted(ours / ref for ours, ref in (R.recipe(seed, 300, 40) for seed in range(3)))
    assert ratios[1] <= 1.2, ratios


@pytest.mark.slow
def test_lbfgs_in_float16_stalls_at_float16s_resolution_of_the_residual(highest_precision):
    """L-BFGS under fp16 + DerivScaler (boundary in float32) after 300 Adam steps: it trains (the
    error falls below Adam's) but it stalls where float16 resolves u'' (2^-11 of it, about 4e-3 of
    the dimensionless residual) while float32 goes on: after 160 steps its error stays above
    1e-4, fp32's is below 3e-5 (measured, seed 0: 3.5e-4 and 1.9e-5)."""
    params, state, _ = R.adam(P.DERIV_SCALER, 0, 300, fp32_boundary=True)
    lb, skipped = R.lbfgs_float16(params, state, 160, fp32_boundary=True)
    ref, _, _ = R.adam(P.FP32, 0, 300)
    ref = R.lbfgs_float32(ref, 160)
    assert R.error(lb) < R.error(params) and skipped <= 5
    assert R.error(lb) > 1e-4 and R.error(ref) < 3e-5, (R.error(lb), R.error(ref))
