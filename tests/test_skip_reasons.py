"""Each skip names its true cause, under fp16 + DerivScaler, plain fp16 and bf16, with the user's
own ``jax.grad`` through an autocast network and ``jaxamp.optimizer``: a NaN point in the batch is
bad values (no scaler moves), a second derivative beyond float16 is an overflow of key "2" (that
key backs off), non-finite weight gradients back the loss scale off. Compiled with XLA's excess
precision off (every float16 operation rounds to float16), so the overflows are float16's own."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp

STRICT_FP16 = {"xla_allow_excess_precision": False}
MODEL = nn.Sequential([nn.Dense(16), jnp.tanh, nn.Dense(16), jnp.tanh, nn.Dense(1)])
X = jnp.linspace(-0.02, 0.02, 8)
CONFIGS = {
    "fp16+DS": jaxamp.AmpConfig(autocast_firstlayer=True),
    "plain fp16": jaxamp.AmpConfig(autocast_firstlayer=True, derivative_scaling=False),
    "bf16": jaxamp.AmpConfig(autocast_firstlayer=True, dtype="bfloat16"),
}


def params(gain=1.0, out=1.0):
    """The network's parameters, its first layer's kernel times ``gain`` and its last's times ``out``."""
    p = MODEL.init(jax.random.PRNGKey(0), jnp.zeros(1))

    def times(path, v):
        name = jax.tree_util.keystr(path)
        return v * (gain if "layers_0" in name else out if "layers_4" in name else 1.0) if "kernel" in name else v

    return jax.tree_util.tree_map_with_path(times, p)


def step_reason(amp, p, x, *, loss_gain=1.0):
    """The skip reason of one step of ``mean(u_xx^2) * loss_gain`` with the user's nested jax.grad."""
    net = jaxamp.autocast(MODEL.apply, amp)
    u = lambda p, x: net(p, x[None])[0]  # noqa: E731
    u_xx = jax.grad(jax.grad(u, 1), 1)

    def loss(p, x, g):
        return jnp.mean(jax.vmap(u_xx, (None, 0))(p, x) ** 2) * g

    state = jaxamp.init(loss, amp, from_profile=False)(params(), X, 1.0)
    tx = jaxamp.optimizer(optax.adam(1e-3), amp_state=state)

    def step(opt_state, p, x, g):
        _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, p, x, g)
        return tx.update(grads, opt_state, p, flags=flags)[1]

    after = jax.jit(step, compiler_options=STRICT_FP16)(tx.init(p), p, x, jnp.float32(loss_gain))
    return jaxamp.SkipReason(int(after.skip_reason)), state, after.amp


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_nan_point_is_bad_values_and_moves_no_scaler(name):
    reason, before, after = step_reason(CONFIGS[name], params(), X.at[3].set(jnp.nan))
    assert reason == jaxamp.SkipReason.NONFINITE_VALUES
    assert float(after.loss_scale) == float(before.loss_scale) and after.scales == before.scales


def test_a_second_derivative_beyond_float16_is_an_overflow_of_its_own_key():
    # |u_xx| up to 1.4e5 (float32), |u_x| up to 215: the second order overflows float16, the first does not
    reason, before, after = step_reason(CONFIGS["fp16+DS"], params(gain=400.0, out=4.0), X)
    assert reason == jaxamp.SkipReason.DERIVATIVE_OVERFLOW
    assert float(after.scales["2"]) == float(before.scales["2"]) / 2 and float(after.scales["1"]) == float(
        before.scales["1"])
    assert float(after.loss_scale) == float(before.loss_scale)


@pytest.mark.parametrize("name", ["fp16+DS", "plain fp16"])
def test_weight_gradients_beyond_float16_back_the_loss_scale_off(name):
    # the loss times 2^12 at the initial loss scale 2^16: its float16 cotangents overflow, the derivatives do not
    reason, before, after = step_reason(CONFIGS[name], params(), X, loss_gain=2.0**12)
    assert reason == jaxamp.SkipReason.NONFINITE_GRADS
    assert float(after.loss_scale) == float(before.loss_scale) / 2 and after.scales == before.scales


def test_the_applied_step_is_clean_in_every_precision():
    for amp in CONFIGS.values():
        assert step_reason(amp, params(), X)[0] == jaxamp.SkipReason.APPLIED


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_source_term_overflowing_in_the_users_float16_is_bad_values_and_moves_no_scaler(name):
    """A float16 batch whose source term (computed by the user in float16, outside the network)
    passes 65504: the loss is non-finite before any gradient, which no scale cures: bad values,
    not non-finite weight gradients (the loss scale would back off to its floor for nothing)."""
    amp = CONFIGS[name]
    net = jaxamp.autocast(MODEL.apply, amp)
    u_xx = jax.grad(jax.grad(lambda p, x: net(p, x[None])[0], 1), 1)

    def loss(p, x16):
        source = (x16 * jnp.float16(300.0)) ** 2  # float16: |x| = 1 gives 9e4, past 65504
        return jnp.mean((jax.vmap(u_xx, (None, 0))(p, x16.astype(jnp.float32)) - source) ** 2)

    x16 = jnp.linspace(-0.02, 0.02, 8).astype(jnp.float16)
    state = jaxamp.init(loss, amp, from_profile=False)(params(), x16)
    tx = jaxamp.optimizer(optax.adam(1e-3), amp_state=state)

    @jax.jit
    def step(opt_state, p, x16):
        _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, p, x16)
        return tx.update(grads, opt_state, p, flags=flags)[1]

    # without the point the loss is finite (its scaled backward may still overflow: the loss scale's to cure)
    assert int(step(tx.init(params()), params(), x16).skip_reason) != jaxamp.SkipReason.NONFINITE_VALUES
    after = step(tx.init(params()), params(), x16.at[3].set(1.0))  # a finite float16 point
    assert int(after.skip_reason) == jaxamp.SkipReason.NONFINITE_VALUES
    assert float(after.amp.loss_scale) == float(state.loss_scale) and after.amp.scales == state.scales
