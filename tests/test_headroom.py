"""Headroom per scaler key in the train-step metrics: analytic values, scale shifts, the
extra-metrics contract of loss functions (``(loss, terms)`` or ``(loss, (terms, metrics))``),
no recompilation, errors. The headroom reads the scales of the program it runs in
(``jaxamp.scaled``, ``jaxamp.value_and_grad``, ``make_train_step``; 1 outside them)."""

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


def _headroom_at(eng, scales, params, points):
    """``((values, headroom), found_inf)`` of one engine call under ``jaxamp.scaled`` at ``scales``:
    the headroom reads the scales of the program it runs in."""
    def program(p, x):
        values = eng(p, x)
        return values, jaxamp.headroom.headroom_log2(eng, values)

    return jaxamp.scaled(program, eng.amp)(scales, params, points)


@pytest.mark.parametrize("k", [3.0, 40.0])
def test_headroom_matches_the_analytic_peak_of_each_key(k):
    eng, params = _engine(k), {"a": jnp.float32(1.5)}
    (values, h), _ = jax.jit(lambda s, p, x: _headroom_at(eng, s, p, x))(ONES, params, POINTS)
    assert sorted(h) == ["1", "2"]
    np.testing.assert_allclose(float(h["1"]), LOG2_FP16_MAX - math.log2(1.5 * k), atol=1e-3)
    np.testing.assert_allclose(float(h["2"]), LOG2_FP16_MAX - math.log2(1.5 * k * k), atol=1e-3)
    # outside any jaxamp.scaled the program runs at scale 1: the same headroom
    plain = jax.jit(lambda v: jaxamp.headroom.headroom_log2(eng, v))(eng(params, POINTS))
    assert {key: float(v) for key, v in plain.items()} == {key: float(v) for key, v in h.items()}


@pytest.mark.parametrize("e", [-7, 3])
def test_a_scale_of_two_to_the_e_shifts_the_headroom_by_exactly_e(e):
    eng, params = _engine(10.0), {"a": jnp.float32(1.0)}
    scales = {"1": jnp.float32(1.0), "2": jnp.float32(2.0**e)}
    (base_values, base), _ = _headroom_at(eng, ONES, params, POINTS)
    (values, shifted), _ = _headroom_at(eng, scales, params, POINTS)
    # the engine's (unscaled) values do not depend on the scales; the headroom does
    np.testing.assert_allclose(np.asarray(values["u__x__x"]), np.asarray(base_values["u__x__x"]), rtol=1e-6)
    assert float(base["2"]) - float(shifted["2"]) == pytest.approx(e, abs=1e-5)
    assert float(shifted["1"]) == float(base["1"])


def test_an_overflow_shows_as_negative_headroom_and_zeros_as_infinite():
    k = 300.0  # a k^2 = 9e4 > 65504 at scale 1, in a float16 network
    fp16 = lambda p, x: (jnp.sin(x.astype(jnp.float16) * jnp.float16(k)) * p["a"].astype(jnp.float16)).astype(jnp.float32)  # noqa: E731
    eng = jaxamp.Derivatives(fp16, inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=jaxamp.AmpConfig())
    (_, h), found_inf = _headroom_at(eng, ONES, {"a": jnp.float32(1.0)}, POINTS)
    assert bool(found_inf["2"]) and float(h["2"]) < 0
    zero = _engine(3.0)
    (_, hz), _ = _headroom_at(zero, ONES, {"a": jnp.float32(0.0)}, POINTS)
    assert float(hz["2"]) == math.inf


def test_unscaled_engines_have_no_keys_and_merging_takes_the_minimum():
    plain = _engine(3.0, jaxamp.AmpConfig(enabled=False))
    values = plain({"a": jnp.float32(1.0)}, POINTS)
    assert jaxamp.headroom.headroom_log2(plain, values) == {}
    (_, h), found = _headroom_at(plain, {}, {"a": jnp.float32(1.0)}, POINTS)
    assert h == {} and found == {}
    merged = jaxamp.headroom.headroom_metrics({"2": jnp.float32(3.0)}, {"2": jnp.float32(1.5), "1": jnp.float32(9.0)})
    assert {k: float(v) for k, v in merged.items()} == {"headroom_log2/2": 1.5, "headroom_log2/1": 9.0}


# key "2" held at 2^3 (its max): the step's headroom under it is 3 lower than at scale 1
SCALE8 = jaxamp.AmpConfig(custom_max_scales_log2={2: 3}, custom_init_scales_log2={2: 3})


def _problem(with_metrics: bool, amp=None):
    amp = jaxamp.AmpConfig() if amp is None else amp
    eng = _engine(10.0, amp)

    def loss_fn(params, points):
        values = eng(params, points)
        loss = jnp.mean((values["u__x__x"] + 100.0 * values["u"]) ** 2)
        if not with_metrics:
            return loss, {"pde": loss}
        return loss, ({"pde": loss}, jaxamp.headroom.headroom_metrics(jaxamp.headroom.headroom_log2(eng, values)))

    opt = optax.adam(1e-3)
    state = jaxamp.train.TrainState.create(params={"a": jnp.float32(1.0)}, optimizer=opt, amp=amp, engines=[eng])
    return state, jaxamp.train.make_train_step(loss_fn, opt, amp=amp), loss_fn


@pytest.mark.parametrize("amp,shift2", [(None, 0), (SCALE8, 3)], ids=["scale1", "scale8"])
def test_make_train_step_reports_headroom_per_key_without_recompiling(amp, shift2):
    state, step, _ = _problem(with_metrics=True, amp=amp)
    assert float(state.deriv_scales["2"].scale) == 2.0**shift2 and float(state.deriv_scales["1"].scale) == 1.0
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


def test_terms_only_and_terms_with_metrics_loss_functions_work_everywhere():
    state, step, loss_fn = _problem(with_metrics=False)
    _, metrics = jax.jit(step)(state, POINTS[:64])
    assert not any(k.startswith("headroom_log2/") for k in metrics) and "terms/pde" in metrics
    amp = jaxamp.AmpConfig()
    amp_state = jaxamp.AmpState(amp, state.deriv_scales, state.loss_scale, amp.make_loss_scaler())
    (loss, aux), _ = jaxamp.value_and_grad(loss_fn, has_aux=True)(amp_state, state.params, POINTS[:64])
    assert sorted(aux) == ["pde"] and float(aux["pde"]) == float(loss)
    state8, _, loss3 = _problem(with_metrics=True, amp=SCALE8)
    amp_state8 = jaxamp.AmpState(SCALE8, state8.deriv_scales, state8.loss_scale, SCALE8.make_loss_scaler())
    (_, aux3), _ = jaxamp.value_and_grad(loss3, has_aux=True)(amp_state8, state8.params, POINTS[:64])
    terms3, metrics3 = aux3
    assert sorted(terms3) == ["pde"] and sorted(metrics3) == ["headroom_log2/1", "headroom_log2/2"]
    # under value_and_grad the headroom reads the state's scales (key "2" at 2^3): 3 below scale 1's
    (_, at_one), _ = jaxamp.scaled(loss3, SCALE8)(ONES, state8.params, POINTS[:64])
    assert float(at_one[1]["headroom_log2/2"]) - float(metrics3["headroom_log2/2"]) == pytest.approx(3, abs=1e-5)
    assert float(at_one[1]["headroom_log2/1"]) == float(metrics3["headroom_log2/1"])


def test_bad_inputs_name_the_argument_the_value_and_what_is_allowed():
    eng = _engine(3.0)
    values = eng({"a": jnp.float32(1.0)}, POINTS)
    with pytest.raises(TypeError, match=r"`engine`='eng'.*expected a jaxamp.Derivatives"):
        jaxamp.headroom.headroom_log2("eng", values)
    with pytest.raises(TypeError, match=r"`values` must be the engine's \{name: array\} dict, got list"):
        jaxamp.headroom.headroom_log2(eng, [values])
    with pytest.raises(KeyError, match=r"`values` lacks the derivative\(s\) \['u__x__x'\]"):
        jaxamp.headroom.headroom_log2(eng, {k: v for k, v in values.items() if k != "u__x__x"})
    # a scale missing for a key the headroom reads: jaxamp.scaled names the key and the keys it has
    with pytest.raises(KeyError, match=r"jaxamp.scaled: the program takes a derivative with scaler key '2'.*"
                                       r"`scales` has only the keys \['1'\]"):
        jaxamp.scaled(lambda v: jaxamp.headroom.headroom_log2(eng, v), eng.amp)({"1": jnp.float32(1.0)}, values)
    with pytest.raises(TypeError, match=r"argument 0=3.0 is not allowed"):
        jaxamp.headroom.headroom_metrics(3.0)

    state, _, _ = _problem(with_metrics=False)
    amp, opt = jaxamp.AmpConfig(), optax.adam(1e-3)

    def clashing(params, points):
        v = eng(params, points)
        return jnp.mean(v["u"]), ({}, {"loss": jnp.mean(v["u"])})

    with pytest.raises(ValueError, match=r"metric name\(s\) \['loss'\] are not allowed"):
        jaxamp.train.make_train_step(clashing, opt, amp=amp)(state, POINTS[:64])


def test_a_non_scalar_metric_is_rejected_naming_it_and_what_is_allowed():
    eng = _engine(3.0)
    state, _, _ = _problem(with_metrics=False)
    amp, opt = jaxamp.AmpConfig(), optax.adam(1e-3)

    def vector_metric(params, points):
        v = eng(params, points)
        return jnp.mean(v["u"]), ({}, {"peak": jnp.abs(v["u"])})

    with pytest.raises(TypeError, match=r"metric 'peak'.*shape \(64,\).*scalar"):
        jaxamp.train.make_train_step(vector_metric, opt, amp=amp)(state, POINTS[:64])
