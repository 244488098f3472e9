"""A Derivatives engine is a derivative program: it takes no scales, and the transformations
(`jaxamp.scaled`, `jaxamp.value_and_grad`, the train step) give it its scales and collect its
flags, as for the drop-in derivatives (docs/algorithm.md, "One derivative step")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES


def two_outputs(p, x):
    """``u = p sin(x)`` (differentiated) and ``q``, no derivative taken of it: NaN where ``x > 10``."""
    return jnp.stack([p * jnp.sin(x[0]), jnp.where(x[0] > 10.0, jnp.nan, x[0])])


def engine(**amp):
    return jaxamp.Derivatives(two_outputs, inputs=("x",), outputs=("u", "q"), derivatives=("u__x__x",),
                              amp=jaxamp.AmpConfig(**amp))


POINTS = jnp.array([[0.1], [0.5], [1.0]], jnp.float32)
SCALES = {"1": jnp.float32(0.5), "2": jnp.float32(0.25)}


@pytest.mark.parametrize("method", ["forward", pytest.param("reverse", marks=pytest.mark.slow)])
def test_an_output_no_derivative_is_taken_of_is_checked_for_bad_values(method):
    eng = jaxamp.Derivatives(two_outputs, inputs=("x",), outputs=("u", "q"), derivatives=("u__x__x",),
                             amp=jaxamp.AmpConfig(), method=method)
    _, clean = jaxamp.scaled(eng)(SCALES, 2.0, POINTS)
    values, found = jaxamp.scaled(eng)(SCALES, 2.0, jnp.concatenate([POINTS, jnp.array([[20.0]])]))
    assert {k: bool(v) for k, v in clean.items()} == {"1": False, "2": False, NONFINITE_VALUES: False}
    assert {k: bool(v) for k, v in found.items()} == {"1": False, "2": False, NONFINITE_VALUES: True}
    assert bool(jnp.isnan(values["q"][-1])) and bool(jnp.all(jnp.isfinite(values["u__x__x"])))


def test_the_engine_takes_no_scales_and_outside_scaled_is_the_program_at_scale_1():
    eng = engine()
    plain = eng(2.0, POINTS)
    at_one, _ = jaxamp.scaled(eng)({"1": 1.0, "2": 1.0}, 2.0, POINTS)
    scaled_values, _ = jaxamp.scaled(eng)(SCALES, 2.0, POINTS)
    x = np.asarray(POINTS[:, 0], np.float64)
    np.testing.assert_allclose(plain["u__x__x"], -2.0 * np.sin(x), rtol=1e-6)
    for name in eng.names:  # binary scales: float32 values unchanged to the bit
        np.testing.assert_array_equal(plain[name], at_one[name])
        np.testing.assert_array_equal(plain[name], scaled_values[name])
    with pytest.raises(TypeError, match=r"takes \(params, points\) and no scales: jaxamp.scaled\(engine\)"):
        eng(2.0, POINTS, SCALES)


def test_scaled_takes_the_engines_amp_unless_given_one():
    eng = engine(mode="per_term_scaler")
    assert eng.scaler_keys == ("u", "u__x")
    _, found = jaxamp.scaled(eng)({"u": 1.0, "u__x": 1.0}, 2.0, POINTS)
    assert sorted(found) == ["nonfinite_values", "u", "u__x"]
    with pytest.raises(KeyError, match="scaler key '1'"):  # per-order keys from the given amp
        jaxamp.scaled(eng, jaxamp.AmpConfig())({"u": 1.0, "u__x": 1.0}, 2.0, POINTS)


def test_a_missing_scale_names_the_key():
    with pytest.raises(KeyError, match="scaler key '2'"):
        jaxamp.scaled(engine())({"1": 1.0}, 2.0, POINTS)


def test_a_loss_over_two_engine_calls_ors_their_flags():
    """The interior call overflows key 2 (a float32 overflow: 2**120 * sin at scale 1), the boundary call does not."""
    eng = engine()

    def loss(p, interior, boundary):
        return jnp.mean(eng(p, interior)["u__x__x"] ** 2) + jnp.mean(eng(p, boundary)["u"] ** 2)

    big = jnp.array([[1.0]], jnp.float32)
    _, found = jaxamp.scaled(loss, eng.amp)({"1": 1.0, "2": 2.0**120}, jnp.float32(2.0**10), big, POINTS)
    assert {k: bool(v) for k, v in found.items()} == {"1": False, "2": True, NONFINITE_VALUES: False}
    state = jaxamp.init(loss, eng.amp, from_profile=False)(2.0, POINTS, POINTS)
    value, grads, flags = jax.jit(jaxamp.value_and_grad(loss))(state, jnp.float32(2.0), POINTS, POINTS)
    assert sorted(flags.found_inf) == ["1", "2", "nonfinite_values"] and bool(jnp.isfinite(value))


def test_the_train_step_merges_only_when_asked_and_the_loss_is_the_same():
    import optax

    eng = engine()

    def loss_fn(p, batch):
        v = eng(p, batch)
        pde = jnp.mean((v["u__x__x"] + v["u"]) ** 2)
        return pde, {"pde": pde}

    opt = optax.sgd(1e-2)
    state = jaxamp.TrainState.create(params=jnp.float32(2.0), optimizer=opt, amp=eng.amp, engines=[eng])
    steps = {m: jax.jit(jaxamp.make_train_step(loss_fn, opt, amp=eng.amp, merge=m)) for m in (False, True)}
    (a, ma), (b, mb) = (steps[m](state, POINTS) for m in (False, True))
    assert float(ma["loss"]) == float(mb["loss"]) and not bool(ma["skipped"]) and not bool(mb["skipped"])
    np.testing.assert_allclose(a.params, b.params, rtol=1e-6)
    with pytest.raises(TypeError, match="`merge`='yes' must be True or False"):
        jaxamp.make_train_step(loss_fn, opt, amp=eng.amp, merge="yes")


def test_a_train_state_starts_from_the_profile_of_an_engine_loss():
    """u = 2**15 sin(x) in float16 ops: |u_xx| near 2**15 fits float16 without the margin of 2**2 the profile keeps."""
    import optax

    def big(p, x):
        h = x.astype(jnp.float16)
        return jnp.stack([(p.astype(jnp.float16) * jnp.sin(h[0])).astype(jnp.float32), x[0]])

    amp = jaxamp.AmpConfig()
    eng = jaxamp.Derivatives(big, inputs=("x",), outputs=("u", "q"), derivatives=("u__x__x",), amp=amp)
    loss_fn = lambda p, x: (jnp.mean(eng(p, x)["u__x__x"] ** 2) * 1e-9, {})  # noqa: E731
    p, x = jnp.float32(2.0**15), jnp.linspace(1.0, 1.5, 8)[:, None]
    started = jaxamp.init(lambda p, x: loss_fn(p, x)[0], amp)(p, x)
    state = jaxamp.TrainState.create(params=p, optimizer=optax.sgd(0.0), amp=amp, engines=[eng],
                                           amp_state=started)
    assert {k: float(v) for k, v in state.scales.items()} == {k: float(v) for k, v in started.scales.items()}
    assert float(state.scales["2"]) < 1.0  # the profile put key 2 below its max of 1
    _, metrics = jax.jit(jaxamp.make_train_step(loss_fn, optax.sgd(0.0), amp=amp))(state, x)
    assert not bool(metrics["found_inf/2"])
    with pytest.raises(ValueError, match="`amp_state` was created with another AmpConfig"):
        jaxamp.TrainState.create(params=p, optimizer=optax.sgd(0.0), amp=jaxamp.AmpConfig(mode="per_term_scaler"),
                                       amp_state=started)
    with pytest.raises(TypeError, match="`amp_state`=.* must be None or the AmpState"):
        jaxamp.TrainState.create(params=p, optimizer=optax.sgd(0.0), amp=amp, amp_state=started.scales)
    with pytest.raises(KeyError, match=r"no scaler for the engines' key\(s\) \['1', '2'\]"):
        jaxamp.TrainState.create(params=p, optimizer=optax.sgd(0.0), amp=amp, engines=[eng],
                                       amp_state=jaxamp.init(None, amp)())
