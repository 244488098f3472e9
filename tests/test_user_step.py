"""The user's step: jaxamp.init, value_and_grad, apply_or_skip and the optax wrapper.

Oracles: JAX's own value_and_grad (fp32 means off), the step pieces they replace
(jaxamp._src.training.step.check_step / update_scalers: skip decisions and scale trajectories bit for bit),
the update rule's arithmetic (a clean run grows every scaler to its configured max).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jaxamp
from jaxamp._src.training.step import StepFlags, check_step, update_scalers


class MLP(nn.Module):
    @nn.compact
    def __call__(self, z):
        h = jnp.concatenate([jnp.sin(z), jnp.cos(z)], -1)
        for _ in range(2):
            h = jnp.tanh(nn.Dense(16)(h))
        return nn.Dense(1)(h)[0]


MODEL = MLP()
PARAMS = MODEL.init(jax.random.PRNGKey(0), jnp.zeros(2))
T = jnp.linspace(0.0, 1.0, 32)
X = jnp.linspace(-1.0, 1.0, 32)


@jax.custom_jvp
def inject(v, bad):
    """``v`` itself, whose derivative is multiplied by inf where ``bad`` (a bool: a non-finite
    argument would be bad data): an injected overflow of the next derivative step below which
    every value stays finite."""
    return v


@inject.defjvp
def _inject_jvp(primals, tangents):
    (v, bad), (dv, _) = primals, tangents
    return v, dv * jnp.where(bad, jnp.inf, 1.0).astype(dv.dtype)


def make_loss(amp, grad=jaxamp.grad):
    """A Burgers-like residual loss by nested ``grad`` (jaxamp.grad; jax.grad: the user's plain
    program); ``bad`` (True) injects an overflow into the step of u_xx (key "2")."""

    def u_net(params, t, x):
        return jaxamp.autocast(MODEL.apply, amp)(params, jnp.stack([t, x]))

    def r_net(params, t, x, bad):
        u = u_net(params, t, x)
        u_t, u_x = grad(u_net, argnums=(1, 2))(params, t, x)
        u_xx = grad(lambda p, t, x: inject(grad(u_net, 2)(p, t, x), bad), argnums=2)(params, t, x)
        return u_t + u * u_x - 0.01 * u_xx

    def loss(params, t, x, bad=False):
        return jnp.mean(jax.vmap(r_net, (None, 0, 0, None))(params, t, x, bad) ** 2)

    return loss


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_fp32_means_off_values_and_grads_are_jax_s():
    amp = jaxamp.AmpConfig(enabled=False)
    loss = make_loss(amp)
    state = jaxamp.init(loss, amp)(PARAMS, T, X)
    assert state.scales == {} and state.loss_rule is None and float(state.loss_scale) == 1.0
    assert amp.make_loss_scaler() is None and jaxamp.AmpConfig(dtype="float32").make_loss_scaler() is None
    value, grads, flags = jax.jit(jaxamp.value_and_grad(loss))(state, PARAMS, T, X)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(make_loss(amp, jax.grad)))(PARAMS, T, X)  # the user's program
    assert flags.found_inf == {}
    np.testing.assert_array_equal(value, ref_value)
    jax.tree.map(np.testing.assert_array_equal, grads, ref_grads)
    _, state = jaxamp.apply_or_skip(state, grads, flags, PARAMS, PARAMS)
    assert float(state.loss_scale) == 1.0 and state.scales == {}


def test_has_aux_and_argnums_follow_jax():
    amp = jaxamp.AmpConfig()
    loss = make_loss(amp)
    state = jaxamp.init(loss, amp, from_profile=False)(PARAMS, T, X)
    (value, aux), grads, flags = jaxamp.value_and_grad(lambda p, t, x: (loss(p, t, x), {"n": 1}), has_aux=True)(
        state, PARAMS, T, X)
    assert aux == {"n": 1} and sorted(flags.found_inf) == ["1", "2", "nonfinite_values"]
    assert all(v.dtype == jnp.bool_ for v in flags.found_inf.values())
    _, both, _ = jaxamp.value_and_grad(loss, argnums=(0, 1))(state, PARAMS, T, X)
    assert isinstance(both, tuple) and both[1].shape == T.shape


def test_skip_decisions_and_scale_trajectories_equal_the_step_pieces():
    amp = jaxamp.AmpConfig(derivative_scaler={"growth_interval": 3, "recover_growth_interval": 2})
    loss = make_loss(amp)
    state = jaxamp.init(loss, amp, from_profile=False)(PARAMS, T, X)
    vg = jax.jit(jaxamp.value_and_grad(loss))
    step_fn = jax.jit(jaxamp.apply_or_skip)
    scalers, loss_scale, rule = state.derivative, state.loss, amp.make_loss_scaler()
    params = PARAMS
    for i in range(8):
        bad = jnp.bool_(i in (2, 5))
        value, grads, flags = vg(state, params, T, X, bad)
        new = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        kept, state = step_fn(state, grads, flags, new, params)
        check = check_step(scalers, flags.found_inf, grads)
        scalers, loss_scale = update_scalers(scalers, loss_scale, rule, check)
        expected = check.select(new, params)
        jax.tree.map(np.testing.assert_array_equal, kept, expected)
        assert bool(flags.found_inf["2"]) == (i in (2, 5))
        for k in scalers:
            np.testing.assert_array_equal(state.derivative[k].scale, scalers[k].scale)
            np.testing.assert_array_equal(state.derivative[k].growth_tracker, scalers[k].growth_tracker)
        np.testing.assert_array_equal(state.loss.scale, loss_scale.scale)
        params = kept
    assert float(state.scales["2"]) < 1.0  # two backoffs, fewer clean steps than it takes to regrow


def test_optimizer_skips_with_a_zero_update_and_the_inner_state_unchanged():
    amp = jaxamp.AmpConfig()
    loss = make_loss(amp)
    state = jaxamp.init(loss, amp, from_profile=False)(PARAMS, T, X)
    tx = jaxamp.optimizer(optax.adam(1e-2), amp_state=state)
    opt_state = tx.init(PARAMS)
    _, clean, flags = jaxamp.value_and_grad(loss)(opt_state, PARAMS, T, X)
    updates, opt_state = tx.update(clean, opt_state, PARAMS, flags=flags)
    assert int(opt_state.skip_reason) == 0 and int(opt_state.inner[0].count) == 1
    _, bad, flags = jaxamp.value_and_grad(loss)(opt_state, PARAMS, T, X, jnp.bool_(True))
    updates, skipped = tx.update(bad, opt_state, PARAMS, flags=flags)
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))
    jax.tree.map(np.testing.assert_array_equal, skipped.inner, opt_state.inner)
    assert int(skipped.skip_reason) == int(jaxamp.SkipReason.DERIVATIVE_OVERFLOW)
    assert float(skipped.amp.scales["2"]) == 0.5 and float(skipped.amp.scales["1"]) == 1.0
    # non-finite gradients with clean flags (a plain found_inf dict): skipped, as optax.apply_if_finite
    # but without a limit, and the loss scale backs off
    nan_grads = jax.tree.map(lambda g: g * jnp.nan, clean)
    updates, after = tx.update(nan_grads, opt_state, PARAMS, flags={})
    assert int(after.skip_reason) == int(jaxamp.SkipReason.NONFINITE_GRADS)
    assert float(after.amp.loss_scale) == float(opt_state.amp.loss_scale) / 2
    # gradients without flags while a scaler acts (e.g. from jax.value_and_grad): unscaled, an error
    with pytest.raises(TypeError, match=r"without `flags` while a scaler acts.*jaxamp.value_and_grad"):
        tx.update(clean, opt_state, PARAMS)


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_flax_train_state_needs_no_new_field():
    """The AMP state lives in ``ts.opt_state``; apply_gradients passes the optimizer no extra
    argument, so the step writes out its update given the flags and its replace (an error names
    value_and_grad where apply_gradients would drop the flags)."""
    amp = jaxamp.AmpConfig()
    loss = make_loss(amp)
    amp_state = jaxamp.init(loss, amp, from_profile=False)(PARAMS, T, X)
    ts = train_state.TrainState.create(apply_fn=MODEL.apply, params=PARAMS,
                                       tx=jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state))

    @jax.jit
    def step(ts, bad):
        value, grads, flags = jaxamp.value_and_grad(loss)(ts.opt_state, ts.params, T, X, bad)
        updates, opt_state = ts.tx.update(grads, ts.opt_state, ts.params, flags=flags)
        params = optax.apply_updates(ts.params, updates)
        return ts.replace(step=ts.step + 1, params=params, opt_state=opt_state), value

    ts1, v1 = step(ts, jnp.bool_(False))
    ts2, v2 = step(ts1, jnp.bool_(True))
    assert np.isfinite(float(v1)) and int(ts1.step) == 1
    jax.tree.map(np.testing.assert_array_equal, ts2.params, ts1.params)
    assert float(ts2.opt_state.amp.scales["2"]) == float(ts1.opt_state.amp.scales["2"]) / 2
    _, grads, _ = jaxamp.value_and_grad(loss)(ts.opt_state, ts.params, T, X)
    with pytest.raises(TypeError, match=r"without `flags` while a scaler acts.*jaxamp.value_and_grad"):
        ts.apply_gradients(grads=grads)


def test_a_profile_start_is_not_a_cap():
    """A key started low by the profile grows back to its configured max when nothing overflows."""
    amp = jaxamp.AmpConfig(derivative_scaler={"growth_interval": 2, "recover_growth_interval": 1})
    loss = make_loss(amp)
    state = jaxamp.init(loss, amp, from_profile=False)(PARAMS, T, X)
    low = {k: s._replace(scale=jnp.float32(2.0**-5)) for k, s in state.derivative.items()}
    state = state.replace(derivative=jaxamp._src.scaling.scaler.Scalers(state.derivative.rules, low))
    clean = StepFlags({k: jnp.array(False) for k in state.scales})
    advance = jax.jit(lambda s: jaxamp.apply_or_skip(s, {"w": jnp.ones(2)}, clean, 0.0, 0.0)[1])
    for _ in range(40):
        state = advance(state)
    assert {k: float(v) for k, v in state.scales.items()} == {"1": 1.0, "2": 1.0}


def test_apply_or_skip_decides_alike_on_every_replica():
    amp = jaxamp.AmpConfig()
    state = jaxamp.init(None, amp, keys=("2",))()
    flags = {"2": jnp.array([False, True]), "nonfinite_values": jnp.array([False, False])}

    def per_replica(f2, fv):
        flags = {"2": f2, "nonfinite_values": fv}
        return jaxamp.apply_or_skip(state, {"w": jnp.ones(2)}, flags, jnp.float32(1.0), jnp.float32(0.0), axis_name="d")

    kept, new = jax.vmap(per_replica, axis_name="d")(flags["2"], flags["nonfinite_values"])
    np.testing.assert_array_equal(kept, [0.0, 0.0])
    np.testing.assert_array_equal(new.scales["2"], [0.5, 0.5])


@pytest.mark.slow  # slow: tests/test_scale_one.py checks every path at scale 1 in the fast suite
def test_drop_in_at_scale_one_is_bit_identical_to_scaling_off():
    """Every weight gradient of a drop-in loss at scales 1 equals the same code with
    derivative_scaling=False, bit for bit (XLA compiles one graph for both)."""
    on, off = jaxamp.AmpConfig(), jaxamp.AmpConfig(derivative_scaling=False)
    for loss_on, loss_off in ((make_loss(on), make_loss(off)),
                              (_poisson(on), _poisson(off))):
        s_on = jaxamp.init(loss_on, on, from_profile=False)(PARAMS, T, X)
        s_off = jaxamp.init(loss_off, off)(PARAMS, T, X)
        s_on = s_on.replace(loss=s_off.loss)
        v1, g1, _ = jax.jit(jaxamp.value_and_grad(loss_on))(s_on, PARAMS, T, X)
        v0, g0, _ = jax.jit(jaxamp.value_and_grad(loss_off))(s_off, PARAMS, T, X)
        np.testing.assert_array_equal(v1, v0)
        jax.tree.map(np.testing.assert_array_equal, g1, g0)


def _poisson(amp):
    def u_net(params, t, x):
        return jaxamp.autocast(MODEL.apply, amp)(params, jnp.stack([t, x]))

    def lap(params, t, x):
        u_tt = jaxamp.grad(jaxamp.grad(u_net, 1), 1)(params, t, x)
        return u_tt + jaxamp.grad(jaxamp.grad(u_net, 2), 2)(params, t, x) + jnp.sin(x)

    return lambda params, t, x: jnp.mean(jax.vmap(lap, (None, 0, 0))(params, t, x) ** 2)


def test_errors_say_what_to_use():
    amp = jaxamp.AmpConfig()
    state = jaxamp.init(None, amp)()
    with pytest.raises(TypeError, match="jaxamp.jacrev"):
        jaxamp.grad(lambda x: jnp.stack([x, x]))(1.0)
    with pytest.raises(TypeError, match="float scalar loss.*jacrev"):
        jaxamp.value_and_grad(lambda p: p * jnp.ones(3))(state, 1.0)
    with pytest.raises(TypeError, match="AmpState"):
        jaxamp.value_and_grad(lambda p: p)({"not": "a state"}, 1.0)
    with pytest.raises(TypeError, match="`inner`"):
        jaxamp.optimizer(object(), amp_state=state)
    with pytest.raises(TypeError, match="`flags` must be the StepFlags of jaxamp.value_and_grad"):
        jaxamp.apply_or_skip(state, [1.0], [1.0], 0.0, 0.0)
    with pytest.raises(TypeError, match="`keys`"):
        jaxamp.init(None, amp, keys="2")


@pytest.mark.slow  # slow: tests/test_dropin_profile.py checks the float32-only case in the fast suite
def test_a_profile_of_float32_only_large_derivatives_starts_every_key_at_its_max():
    """examples/jax_user's network in physical units (domain x 0.02), first layer in float32
    (jaxamp's default placement), nested reverse mode as the user wrote it: u_xx passes 65504 in
    float32 while its float16 values stay small, so the profile starts key "2" at its max."""
    from tests.helpers.jax_user import physical_fourier_net

    amp = jaxamp.AmpConfig()
    u_net, params = physical_fourier_net(amp, c=0.02)
    rev = dict(argnums=2, method="reverse")
    u_xx = jax.vmap(jaxamp.grad(jaxamp.grad(u_net, **rev), **rev), (None, 0, 0))
    t, x = 0.02 * T, 0.02 * X
    assert float(jnp.max(jnp.abs(u_xx(params, t, x)))) > 65504.0
    state = jaxamp.init(u_xx, amp)(params, t, x)
    assert {k: float(s) for k, s in state.scales.items()} == {"1": 1.0, "2": 1.0}
    # a short run from that start: nothing overflows, every key stays at its configured max
    vg = jax.jit(jaxamp.value_and_grad(lambda p, t, x: jnp.mean((1e-4 * u_xx(p, t, x)) ** 2)))
    for _ in range(3):
        _, grads, flags = vg(state, params, t, x)
        new = jax.tree.map(lambda p, g: p - 1e-6 * g, params, grads)
        params, state = jaxamp.apply_or_skip(state, grads, flags, new, params)
        assert not any(bool(v) for v in flags.found_inf.values()), flags.found_inf
    assert {k: float(s) for k, s in state.scales.items()} == {"1": 1.0, "2": 1.0}


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_non_array_arguments_pass_through_as_in_jax_grad():
    """A loss taking the network's ``apply_fn`` (flax's TrainState pattern), a string and a
    Python int used in Python control flow: every jaxamp entry point passes them to the loss as
    jax.value_and_grad does, and the fp32 results are JAX's own."""
    amp = jaxamp.AmpConfig(enabled=False)

    def loss(params, apply_fn, t, mode, n_terms):
        def u(p, ti):
            return apply_fn(p, jnp.stack([ti, 0.5 * ti]))

        u_t = jax.vmap(jaxamp.grad(u, argnums=1), (None, 0))(params, t)
        total = sum(jnp.mean(u_t**k) for k in range(1, n_terms + 1))  # a Python loop over an int
        return total * (2.0 if mode == "eval" else 1.0)

    args = (PARAMS, MODEL.apply, T, "eval", 2)
    state = jaxamp.init(loss, amp)(*args)
    value, grads, _ = jaxamp.value_and_grad(loss)(state, *args)
    ref_value, ref_grads = jax.value_and_grad(loss)(*args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)
    fp16 = jaxamp.AmpConfig()
    state = jaxamp.init(loss, fp16)(*args)  # from a profile, jitted over the array arguments
    assert sorted(state.scales) == ["1"]
    value, found_inf = jaxamp.scaled(loss)(state, *args)
    assert sorted(found_inf) == ["1", "nonfinite_values"] and np.isfinite(float(value))
    assert sorted(jaxamp.profile(loss, fp16)(None, *args).derivatives) == ["1"]
