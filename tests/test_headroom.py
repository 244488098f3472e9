"""Headroom per scaler key in the train-step metrics: analytic values, scale shifts, the
extra-metrics contract of loss functions (old 2-tuple losses unchanged), no recompilation,
errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.headroom import LOG2_FP16_MAX

POINTS = jnp.linspace(0.0, 1.0, 1001)[:, None]  # dense enough to reach sin's peaks


def _sine(k: float):
    """``u(x) = a * sin(k x)`` in float32: max |u__x| = a k, max |u__x__x| = a k^2 on [0, 1] (k >= pi/2)."""
    return lambda p, x: jnp.sin(x * k) * p["a"]


def _engine(k: float, amp=None):
    return jaxamp.Derivatives(_sine(k), inputs=("x",), outputs=("u",), derivatives=("u__x__x",),
                              amp=jaxamp.AmpConfig() if amp is None else amp)


ONES = {"1": jnp.float32(1.0), "2": jnp.float32(1.0)}


@pytest.mark.parametrize("k", [3.0, 40.0])
def test_headroom_matches_the_analytic_peak_of_each_key(k):
    eng, params = _engine(k), {"a": jnp.float32(1.5)}
    values, _ = eng(params, POINTS, ONES)
    h = jax.jit(lambda v, s: jaxamp.headroom.headroom_log2(eng, v, s))(values, ONES)
    assert sorted(h) == ["1", "2"]
    np.testing.assert_allclose(float(h["1"]), LOG2_FP16_MAX - math.log2(1.5 * k), atol=1e-3)
    np.testing.assert_allclose(float(h["2"]), LOG2_FP16_MAX - math.log2(1.5 * k * k), atol=1e-3)


@pytest.mark.parametrize("e", [-7, 3])
def test_a_scale_of_two_to_the_e_shifts_the_headroom_by_exactly_e(e):
    eng, params = _engine(10.0), {"a": jnp.float32(1.0)}
    scales = {"1": jnp.float32(1.0), "2": jnp.float32(2.0**e)}
    base_values, _ = eng(params, POINTS, ONES)
    values, _ = eng(params, POINTS, scales)  # the engine's values do not depend on the scales
    base, shifted = jaxamp.headroom.headroom_log2(eng, base_values, ONES), jaxamp.headroom.headroom_log2(eng, values, scales)
    assert float(base["2"]) - float(shifted["2"]) == pytest.approx(e, abs=1e-5)
    assert float(shifted["1"]) == float(base["1"])


def test_an_overflow_shows_as_negative_headroom_and_zeros_as_infinite():
    k = 300.0  # a k^2 = 9e4 > 65504 at scale 1, in a float16 network
    fp16 = lambda p, x: (jnp.sin(x.astype(jnp.float16) * jnp.float16(k)) * p["a"].astype(jnp.float16)).astype(jnp.float32)  # noqa: E731
    eng = jaxamp.Derivatives(fp16, inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=jaxamp.AmpConfig())
    values, found_inf = eng({"a": jnp.float32(1.0)}, POINTS, ONES)
    h = jaxamp.headroom.headroom_log2(eng, values, ONES)
    assert bool(found_inf["2"]) and float(h["2"]) < 0
    zero = _engine(3.0)
    zeros, _ = zero({"a": jnp.float32(0.0)}, POINTS, ONES)
    assert float(jaxamp.headroom.headroom_log2(zero, zeros, ONES)["2"]) == math.inf


def test_unscaled_engines_have_no_keys_and_merging_takes_the_minimum():
    plain = _engine(3.0, jaxamp.AmpConfig(enabled=False))
    values, _ = plain({"a": jnp.float32(1.0)}, POINTS)
    assert jaxamp.headroom.headroom_log2(plain, values, {}) == {}
    merged = jaxamp.headroom.headroom_metrics({"2": jnp.float32(3.0)}, {"2": jnp.float32(1.5), "1": jnp.float32(9.0)})
    assert {k: float(v) for k, v in merged.items()} == {"headroom_log2/2": 1.5, "headroom_log2/1": 9.0}


def _problem(with_metrics: bool):
    eng = _engine(10.0)

    def loss_fn(params, points, scales):
        values, found_inf = eng(params, points, scales)
        loss = jnp.mean((values["u__x__x"] + 100.0 * values["u"]) ** 2)
        if not with_metrics:
            return loss, ({"pde": loss}, found_inf)
        return loss, ({"pde": loss}, found_inf, jaxamp.headroom.headroom_metrics(jaxamp.headroom.headroom_log2(eng, values, scales)))

    amp = jaxamp.AmpConfig()
    opt = optax.adam(1e-3)
    state = jaxamp.train.TrainState.create(params={"a": jnp.float32(1.0)}, optimizer=opt, amp=amp, engines=[eng])
    return state, jaxamp.train.make_train_step(loss_fn, opt, amp=amp), loss_fn


def test_make_train_step_reports_headroom_per_key_without_recompiling():
    state, step, _ = _problem(with_metrics=True)
    traces = []

    @jax.jit
    def run(state, points):
        traces.append(1)
        return step(state, points)

    for i in range(3):
        before, x = state, POINTS[:64] * (1.0 + 0.1 * i)
        state, metrics = run(state, x)
    assert len(traces) == 1
    assert {"headroom_log2/1", "headroom_log2/2", "scale_log2/2", "terms/pde"} <= set(metrics)
    # the step's headroom is that of the params it started from: |a| k^2 max|sin(k x)|, |a| k (x = 0 included)
    a = abs(float(before.params["a"]))
    peak2 = a * 100.0 * float(jnp.max(jnp.abs(jnp.sin(10.0 * x))))
    np.testing.assert_allclose(float(metrics["headroom_log2/2"]), LOG2_FP16_MAX - math.log2(peak2), atol=1e-3)
    np.testing.assert_allclose(float(metrics["headroom_log2/1"]), LOG2_FP16_MAX - math.log2(a * 10.0), atol=1e-3)


def test_two_tuple_loss_functions_keep_working_everywhere():
    state, step, loss_fn = _problem(with_metrics=False)
    _, metrics = jax.jit(step)(state, POINTS[:64])
    assert not any(k.startswith("headroom_log2/") for k in metrics) and "terms/pde" in metrics
    grad_fn = jaxamp.step.scaled_value_and_grad(loss_fn)
    (loss, aux), _ = grad_fn(state.params, POINTS[:64], state.scales, loss_scale=1.0)
    assert len(aux) == 2
    _, _, loss3 = _problem(with_metrics=True)
    (_, aux3), _ = jaxamp.step.scaled_value_and_grad(loss3)(state.params, POINTS[:64], state.scales, loss_scale=1.0)
    assert len(aux3) == 3 and sorted(aux3[2]) == ["headroom_log2/1", "headroom_log2/2"]


def test_bad_inputs_name_the_argument_the_value_and_what_is_allowed():
    eng = _engine(3.0)
    values, _ = eng({"a": jnp.float32(1.0)}, POINTS, ONES)
    with pytest.raises(TypeError, match=r"`engine`='eng'.*expected a jaxamp.Derivatives"):
        jaxamp.headroom.headroom_log2("eng", values, ONES)
    with pytest.raises(KeyError, match=r"`values` lacks the derivative\(s\) \['u__x__x'\]"):
        jaxamp.headroom.headroom_log2(eng, {k: v for k, v in values.items() if k != "u__x__x"}, ONES)
    with pytest.raises(KeyError, match=r"`scales` lacks the scaler key\(s\) \['2'\]"):
        jaxamp.headroom.headroom_log2(eng, values, {"1": 1.0})
    with pytest.raises(TypeError, match=r"argument 0=3.0 is not allowed"):
        jaxamp.headroom.headroom_metrics(3.0)

    state, _, _ = _problem(with_metrics=False)
    amp, opt = jaxamp.AmpConfig(), optax.adam(1e-3)

    def vector_metric(params, points, scales):
        v, f = eng(params, points, scales)
        return jnp.mean(v["u"]), ({}, f, {"peak": jnp.abs(v["u"])})

    with pytest.raises(TypeError, match=r"metric 'peak' = an array of dtype float32 and shape \(64,\).*scalars"):
        jaxamp.train.make_train_step(vector_metric, opt, amp=amp)(state, POINTS[:64])

    def clashing(params, points, scales):
        v, f = eng(params, points, scales)
        return jnp.mean(v["u"]), ({}, f, {"loss": jnp.mean(v["u"])})

    with pytest.raises(ValueError, match=r"metric name\(s\) \['loss'\] are not allowed"):
        jaxamp.train.make_train_step(clashing, opt, amp=amp)(state, POINTS[:64])
