"""A stall is said: consecutive skips counted in the optimizer's state (and TrainState), a
StallWarning (or StallError) when the count reaches max_consecutive_skips, from a host callback
taken only then; a clean run says nothing; jaxamp.StallMonitor is fed from the optimizer's state."""

import warnings

import jax
import optax
import pytest

import jaxamp
from jaxamp import StallWarning
from tests.test_optax_compose import PARAMS, amp_state, batch, loss


def run(tx, flags, n):
    """``n`` steps of the user's step under lax.scan, every batch with ``flags``."""

    @jax.jit
    def go(params, opt_state):
        def body(carry, _):
            params, opt_state = carry
            _, grads, step_flags = jaxamp.value_and_grad(loss)(opt_state, params, batch(**flags))
            updates, opt_state = tx.update(grads, opt_state, params, flags=step_flags)
            return (optax.apply_updates(params, updates), opt_state), None

        return jax.lax.scan(body, (params, opt_state), None, length=n)[0]

    out = go(PARAMS, tx.init(PARAMS))
    jax.effects_barrier()
    return out


def test_a_run_that_skips_every_step_is_warned_within_the_limit():
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state(), max_consecutive_skips=7)
    with pytest.warns(StallWarning) as record:
        _, opt_state = run(tx, dict(overflow=True), 20)
    lines = [str(w.message) for w in record]
    assert len(lines) == 2 and "14 consecutive skipped steps (max_consecutive_skips=7)" in lines[1]
    assert "overflow in derivative scaler `2`" in lines[0] and "Try: " in lines[0]
    assert int(opt_state.consecutive_skips) == 20
    assert int(opt_state.skip_reason) == jaxamp.SkipReason.DERIVATIVE_OVERFLOW


def test_on_stall_raise_stops_the_run():
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state(), max_consecutive_skips=3, on_stall="raise")
    with pytest.raises(Exception, match="training stalled: 3 consecutive skipped steps"):
        run(tx, dict(nan_grad=True), 5)


def test_a_clean_2000_step_run_says_nothing():
    tx = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, opt_state = run(tx, {}, 2000)
    assert int(jaxamp._src.training.step.find_opt_state(opt_state).consecutive_skips) == 0


def make_train(max_skips=100, on_stall="warn"):
    amp = jaxamp.AmpConfig(dtype="float16", loss_scaler={"init_scale": 2.0**8})
    state = jaxamp.TrainState.create(params=PARAMS, optimizer=optax.adam(1e-3), amp=amp, amp_state=amp_state())
    step = jaxamp.make_train_step(lambda p, b: (loss(p, b), {}), optax.adam(1e-3), amp=amp,
                                        max_consecutive_skips=max_skips, on_stall=on_stall)

    @jax.jit(static_argnames="n")
    def go(state, flags, n):
        return jax.lax.scan(lambda s, _: (step(s, batch(**flags))[0], None), state, None, length=n)[0]

    return state, go


def test_make_train_step_counts_and_says_a_stall_and_a_clean_run_says_nothing():
    state, go = make_train(max_skips=5)
    with pytest.warns(StallWarning, match="5 consecutive skipped steps"):
        stalled = go(state, {"overflow": True}, n=6)
        jax.effects_barrier()
    assert int(stalled.consecutive_skips) == 6
    state, go = make_train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean = go(state, {}, n=2000)
        jax.effects_barrier()
    assert int(clean.consecutive_skips) == 0 and int(clean.step) == 2000


def test_the_monitor_is_fed_from_the_optimizer_state_in_one_line():
    tx = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.optimizer(optax.adam(1e-2), amp_state=amp_state()))
    monitor = jaxamp.StallMonitor(max_consecutive_skips=2, window=10)
    mstate = monitor.init()
    params, opt_state = PARAMS, tx.init(PARAMS)
    for _ in range(2):
        _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, params, batch(nan_grad=True))
        updates, opt_state = tx.update(grads, opt_state, params, flags=flags)
        mstate = monitor.update(mstate, opt_state)
    line = monitor.diagnose(mstate, opt_state)
    assert int(mstate.consecutive_skips) == 2 and "2 consecutive skipped steps" in line
    assert "non-finite weight gradients" in line
    with pytest.raises(TypeError, match="must be the step's metrics .* or an optimizer state holding one AmpOptState"):
        monitor.update(mstate, (1, 2))


def test_the_report_is_a_callback_in_the_step_only_where_asked():
    """make_train_step reports through its metrics by default (no host callback in the step);
    jaxamp.optimizer warns by default; on_stall=None leaves the callback out of either."""
    def callbacks(step_fn, *args):
        return str(jax.make_jaxpr(step_fn)(*args)).count("debug_callback[")

    start = amp_state()
    amp = start.amp
    state = jaxamp.TrainState.create(params=PARAMS, optimizer=optax.adam(1e-3), amp=amp, amp_state=start)
    for on_stall, expected in ((None, 0), ("warn", 1)):
        step = jaxamp.make_train_step(lambda p, b: (loss(p, b), {}), optax.adam(1e-3), amp=amp, on_stall=on_stall)
        assert callbacks(step, state, batch()) == expected, on_stall
    for kwargs, expected in (({}, 1), ({"on_stall": None}, 0)):
        tx = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state(), **kwargs)
        opt_state = tx.init(PARAMS)

        def user_step(opt_state, tx=tx):
            _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, PARAMS, batch())
            return tx.update(grads, opt_state, PARAMS, flags=flags)

        assert callbacks(user_step, opt_state) == expected, kwargs
    stalled = make_train(max_skips=2, on_stall=None)
    assert int(stalled[1](stalled[0], {"overflow": True}, n=3).consecutive_skips) == 3  # still counted
