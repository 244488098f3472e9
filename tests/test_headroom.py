"""Headroom per scaler key (``jaxamp.scaled(..., headroom=True)``, ``StepFlags.headroom_log2``,
``make_train_step(headroom=True)``): analytic values for engines and drop-in programs alike,
exact shifts under binary scales, overflow and zeros, no recompilation, errors. The headroom is
read at the program's check marks, at the scales the program runs with."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._src.core.window import LOG2_FP16_MAX

POINTS = jnp.linspace(0.0, 1.0, 1001)[:, None]  # dense enough to reach sin's peaks


def _sine(k: float):
    """``u(x) = a * sin(k x)`` in float32: max |u__x| = a k, max |u__x__x| = a k^2 on [0, 1] (k >= pi/2)."""
    return lambda p, x: jnp.sin(x * k) * p["a"]


def _engine(k: float, amp=None):
    return jaxamp.Derivatives(_sine(k), inputs=("x",), outputs=("u",), derivatives=("u__x__x",),
                              amp=jaxamp.AmpConfig() if amp is None else amp)


ONES = {"1": jnp.float32(1.0), "2": jnp.float32(1.0)}


def _headroom_at(eng, scales, params, points, merge=True):
    """``(values, found_inf, headroom)`` of one engine call under ``jaxamp.scaled`` at ``scales``."""
    return jaxamp.scaled(eng, merge=merge, headroom=True)(scales, params, points)


def _dropin(k: float):
    """The same u__x__x as a user writes it: nested jaxamp.grad under vmap."""
    u = lambda a, x: jnp.sin(x * k) * a  # noqa: E731
    return jax.vmap(jaxamp.grad(jaxamp.grad(u, 1), 1), (None, 0))


# each k and each merge in the fast suite; the other pairs with -m slow
@pytest.mark.parametrize("k, merge", [(3.0, True), pytest.param(3.0, False, marks=pytest.mark.slow),
                                      pytest.param(40.0, True, marks=pytest.mark.slow), (40.0, False)])
def test_headroom_matches_the_analytic_peak_of_each_key(k, merge):
    eng, params = _engine(k), {"a": jnp.float32(1.5)}
    _, _, h = jax.jit(lambda s, p, x: _headroom_at(eng, s, p, x, merge))(ONES, params, POINTS)
    assert sorted(h) == ["1", "2"]
    np.testing.assert_allclose(float(h["1"]), LOG2_FP16_MAX - math.log2(1.5 * k), atol=1e-3)
    np.testing.assert_allclose(float(h["2"]), LOG2_FP16_MAX - math.log2(1.5 * k * k), atol=1e-3)
    # the same derivatives written with jaxamp.grad: the same headroom (one rule at the marks)
    _, _, hd = jaxamp.scaled(_dropin(k), merge=merge, headroom=True)(ONES, jnp.float32(1.5), POINTS[:, 0])
    assert {key: round(float(v), 4) for key, v in hd.items()} == {key: round(float(v), 4) for key, v in h.items()}


@pytest.mark.parametrize("e", [-7, 3])
def test_a_scale_of_two_to_the_e_shifts_the_headroom_by_exactly_e(e):
    eng, params = _engine(10.0), {"a": jnp.float32(1.0)}
    scales = {"1": jnp.float32(1.0), "2": jnp.float32(2.0**e)}
    base_values, _, base = _headroom_at(eng, ONES, params, POINTS)
    values, _, shifted = _headroom_at(eng, scales, params, POINTS)
    # the engine's (unscaled) values do not depend on the scales; the headroom does
    np.testing.assert_allclose(np.asarray(values["u__x__x"]), np.asarray(base_values["u__x__x"]), rtol=1e-6)
    assert float(base["2"]) - float(shifted["2"]) == pytest.approx(e, abs=1e-5)
    assert float(shifted["1"]) == float(base["1"])


def test_an_overflow_shows_as_negative_headroom_and_zeros_as_infinite():
    k = 300.0  # a k^2 = 9e4 > 65504 at scale 1, in a float16 network
    fp16 = lambda p, x: (jnp.sin(x.astype(jnp.float16) * jnp.float16(k))  # noqa: E731
                         * p["a"].astype(jnp.float16)).astype(jnp.float32)
    eng = jaxamp.Derivatives(fp16, inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=jaxamp.AmpConfig())
    _, found_inf, h = _headroom_at(eng, ONES, {"a": jnp.float32(1.0)}, POINTS)
    assert bool(found_inf["2"]) and float(h["2"]) < 0
    _, _, hz = _headroom_at(_engine(3.0), ONES, {"a": jnp.float32(0.0)}, POINTS)
    assert float(hz["2"]) == math.inf


def test_unscaled_programs_have_no_keys_and_loop_bodies_are_not_reported():
    plain = _engine(3.0, jaxamp.AmpConfig(enabled=False))
    _, found, h = _headroom_at(plain, {}, {"a": jnp.float32(1.0)}, POINTS)
    assert h == {} and found == {}
    # a derivative inside a scan body is flagged but has no headroom (its own trace)
    u_x = jaxamp.grad(lambda x: jnp.sin(3.0 * x))
    looped = lambda xs: jax.lax.scan(lambda c, x: (c, u_x(x)), 0.0, xs)[1]  # noqa: E731
    _, found, h = jaxamp.scaled(looped, headroom=True)({"1": 1.0}, POINTS[:8, 0])
    assert h == {} and sorted(found) == ["1", "nonfinite_values"]


# key "2" held at 2^3 (its max): the step's headroom under it is 3 lower than at scale 1
SCALE8 = jaxamp.AmpConfig(custom_max_scales_log2={2: 3}, custom_init_scales_log2={2: 3})


def _problem(headroom: bool, amp=None):
    amp = jaxamp.AmpConfig() if amp is None else amp
    eng = _engine(10.0, amp)

    def loss_fn(params, points):
        values = eng(params, points)
        loss = jnp.mean((values["u__x__x"] + 100.0 * values["u"]) ** 2)
        return loss, {"pde": loss}

    opt = optax.adam(1e-3)
    state = jaxamp.TrainState.create(params={"a": jnp.float32(1.0)}, optimizer=opt, amp=amp, engines=[eng])
    return state, jaxamp.make_train_step(loss_fn, opt, amp=amp, headroom=headroom), loss_fn


@pytest.mark.parametrize("amp,shift2", [(None, 0), (SCALE8, 3)], ids=["scale1", "scale8"])
def test_make_train_step_reports_headroom_per_key_without_recompiling(amp, shift2):
    state, step, _ = _problem(headroom=True, amp=amp)
    assert (float(state.amp_state.derivative["2"].scale) == 2.0**shift2
            and float(state.amp_state.derivative["1"].scale) == 1.0)
    traces = []

    @jax.jit
    def run(state, points):
        traces.append(1)
        return step(state, points)

    for i in range(3):
        before, x = state, POINTS[:64] * (1.0 + 0.1 * i)
        state, metrics = run(state, x)
    assert len(traces) == 1 and not bool(metrics["skipped"])
    assert float(metrics["scale_log2/2"]) == shift2
    assert {"headroom_log2/1", "headroom_log2/2", "scale_log2/2", "terms/pde"} <= set(metrics)
    # the step's headroom is that of the params and scales it started from:
    # |a| k^2 max|sin(k x)| * 2^shift2 under key "2", |a| k (x = 0 included) at scale 1 under "1"
    a = abs(float(before.params["a"]))
    peak2 = a * 100.0 * float(jnp.max(jnp.abs(jnp.sin(10.0 * x))))
    np.testing.assert_allclose(float(metrics["headroom_log2/2"]), LOG2_FP16_MAX - math.log2(peak2) - shift2, atol=1e-3)
    np.testing.assert_allclose(float(metrics["headroom_log2/1"]), LOG2_FP16_MAX - math.log2(a * 10.0), atol=1e-3)


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_headroom_is_off_by_default_and_value_and_grad_reads_the_states_scales():
    state, step, loss_fn = _problem(headroom=False)
    _, metrics = jax.jit(step)(state, POINTS[:64])
    assert not any(k.startswith("headroom_log2/") for k in metrics) and "terms/pde" in metrics
    state8, _, _ = _problem(headroom=True, amp=SCALE8)
    (_, aux), _, flags = jaxamp.value_and_grad(loss_fn, has_aux=True, headroom=True)(state8.amp_state, state8.params,
                                                                                     POINTS[:64])
    assert sorted(aux) == ["pde"] and sorted(flags.headroom_log2) == ["1", "2"]
    # under value_and_grad the headroom reads the state's scales (key "2" at 2^3): 3 below scale 1's
    _, _, at_one = jaxamp.scaled(loss_fn, SCALE8, headroom=True)(ONES, state8.params, POINTS[:64])
    assert float(at_one["2"]) - float(flags.headroom_log2["2"]) == pytest.approx(3, abs=1e-5)
    assert float(at_one["1"]) == float(flags.headroom_log2["1"])


def test_bad_inputs_name_the_argument_the_value_and_what_is_allowed():
    eng = _engine(3.0)
    with pytest.raises(TypeError, match=r"jaxamp.scaled: `headroom`='yes' must be True or False"):
        jaxamp.scaled(eng, headroom="yes")
    with pytest.raises(TypeError, match=r"make_train_step: `headroom`=1 must be True or False"):
        jaxamp.make_train_step(lambda p, b: (0.0, {}), optax.adam(1e-3), amp=jaxamp.AmpConfig(), headroom=1)

    state, _, _ = _problem(headroom=False)
    amp, opt = jaxamp.AmpConfig(), optax.adam(1e-3)

    def clashing(params, points):
        v = eng(params, points)
        return jnp.mean(v["u"]), ({}, {"loss": jnp.mean(v["u"])})

    with pytest.raises(ValueError, match=r"metric name\(s\) \['loss'\] are not allowed"):
        jaxamp.make_train_step(clashing, opt, amp=amp)(state, POINTS[:64])


def test_a_non_scalar_metric_is_rejected_naming_it_and_what_is_allowed():
    eng = _engine(3.0)
    state, _, _ = _problem(headroom=False)
    amp, opt = jaxamp.AmpConfig(), optax.adam(1e-3)

    def vector_metric(params, points):
        v = eng(params, points)
        return jnp.mean(v["u"]), ({}, {"peak": jnp.abs(v["u"])})

    with pytest.raises(TypeError, match=r"metric 'peak'.*shape \(64,\).*scalar"):
        jaxamp.make_train_step(vector_metric, opt, amp=amp)(state, POINTS[:64])
