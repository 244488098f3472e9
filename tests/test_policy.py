"""One declaration of the AMP policy: autocast's config travels in the traced program
(jaxamp._src.core.policy) and jaxamp.init checks it, or autocast takes init's config."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import AmpConfig, ConfigError
from jaxamp._src.core import policy
from jaxamp import UnscaledDerivativeWarning

FP16 = AmpConfig()
F16 = jnp.dtype("float16")
W = jnp.linspace(-0.5, 0.5, 4).reshape(2, 2)
T = jnp.float32(0.3)


def mlp(w, x):
    return jnp.tanh(jnp.tanh(x @ w) @ w) @ w


def scalar_net(amp):
    """u(w, t): a two-input network under ``autocast(mlp, amp)``."""
    net = jaxamp.autocast(mlp, amp)
    return lambda w, t: net(w, jnp.stack([t, t])[None])[0, 0]


def jaxamp_loss(u):
    return lambda w, t: jaxamp.grad(jaxamp.grad(u, 1), 1)(w, t) ** 2


def dot_dtypes(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.invars[0].aval.dtype)
        for sub in jaxamp._src.core.interpreter.sub_jaxprs(eqn):
            found += dot_dtypes(sub)
    return found


# ---------------------------------------------------------------- the primitive
def test_the_mark_is_an_identity_that_compiles_to_nothing():
    net, x = jaxamp.autocast(mlp, FP16), jnp.ones((3, 2))
    closed = jax.make_jaxpr(net)(W, x)
    assert [e.primitive for e in closed.jaxpr.eqns][-1] is policy.policy_p
    assert policy.policies_in(closed) == [policy.Policy(True, "float16", True, "mlp")]
    hlo = jax.jit(net).lower(W, x).as_text()
    assert "jaxamp" not in hlo and "custom_call" not in hlo
    np.testing.assert_array_equal(jax.jit(net)(W, x), net(W, x))


TS = jnp.linspace(0.1, 0.4, 3)


TRANSFORMS = {
    "jit": jax.jit,
    "vmap": lambda u: jax.vmap(u, (None, 0)),
    "grad": lambda u: jax.grad(u, 1),
    "vmap_hessian": lambda u: jax.vmap(jax.hessian(u, 1), (None, 0)),
    "jacfwd": lambda u: jax.jacfwd(u, 1),
    "scan": lambda u: lambda w, ts: jax.lax.scan(lambda c, t: (c + u(w, t), None), 0.0, ts)[0],
    "checkpoint": jax.checkpoint,
}


@pytest.mark.parametrize("transform, t, derivative", [
    (TRANSFORMS["jit"], T, False),
    (TRANSFORMS["vmap"], TS, False),
    (TRANSFORMS["grad"], T, True),
    (TRANSFORMS["vmap_hessian"], TS, True),
    (TRANSFORMS["jacfwd"], T, True),
    (TRANSFORMS["scan"], TS, False),
    (TRANSFORMS["checkpoint"], T, False),
], ids=["jit", "vmap", "grad", "vmap_hessian", "jacfwd", "scan", "checkpoint"])
def test_the_policy_passes_through_jax_transformations(transform, t, derivative):
    f = transform(scalar_net(FP16))
    closed = jax.make_jaxpr(f)(W, t)
    assert [p.amp_dtype for p in policy.policies_in(closed)] == ["float16"]
    assert policy.derivative_taken(closed) == derivative  # a derivative through the network is seen
    assert policy.derivative_taken(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(f(w, t))))(W))
    if derivative:  # an input derivative of the float16 network runs under the AMP state's scales
        state = jaxamp.init(f, FP16, from_profile=False)(W, t)
        assert sorted(state.scales) == (["1", "2"] if transform is TRANSFORMS["vmap_hessian"] else ["1"])
        assert np.all(np.isfinite(jax.jit(jaxamp.scaled(f))(state, W, t)[0]))
    else:
        assert np.all(np.isfinite(jax.jit(f)(W, t)))


def test_the_mark_changes_no_value_or_gradient():
    plain16 = AmpConfig(derivative_scaling=False)  # JAX's derivatives as written (no boundary rule)
    u = scalar_net(plain16)
    plain = jax.jit(lambda w, t: jaxamp.autocast(mlp, plain16)(w, jnp.stack([t, t])[None])[0, 0])
    np.testing.assert_array_equal(jax.jit(jax.grad(u))(W, T), jax.jit(jax.grad(plain))(W, T))
    np.testing.assert_array_equal(jax.jit(jax.hessian(u, 1))(W, T), jax.jit(jax.hessian(plain, 1))(W, T))


# ---------------------------------------------------------------- init checks the program
@pytest.mark.parametrize("init_amp, differs", [
    (AmpConfig(derivative_scaling=False), "derivative_scaling=True vs derivative_scaling=False"),
    (AmpConfig(dtype="bfloat16"), "dtype='float16' vs dtype='bfloat16'"),
    (AmpConfig(enabled=False), "enabled=True vs enabled=False"),
])
def test_init_with_another_config_than_autocast_is_an_error(init_amp, differs):
    """It was silent: fp16 network, no derivative scaler (1 960 of 2 000 steps skipped)."""
    with pytest.raises(ConfigError) as e:
        jaxamp.init(jaxamp_loss(scalar_net(FP16)), init_amp)(W, T)
    message = str(e.value)
    for fragment in ("autocast(mlp) runs under amp.enabled=True, amp.dtype='float16'", differs,
                     "pass the same AmpConfig to both", "autocast(model.apply, amp) and jaxamp.init(loss, amp)"):
        assert fragment in message, message


def test_a_jitted_network_traced_earlier_is_checked_from_the_program():
    """A jit cache hit runs no Python: the policy is read from the jaxpr."""
    u = jax.jit(scalar_net(AmpConfig(dtype="bfloat16")))
    u(W, T)
    with pytest.raises(ConfigError, match=r"jaxamp.init: autocast\(mlp\) runs under .*amp.dtype='bfloat16'.*"
                                          r"the `amp` given to jaxamp.init has .*amp.dtype='float16'"):
        jaxamp.init(jaxamp_loss(u), FP16)(W, T)


def test_the_same_config_passes_and_keeps_its_keys():
    state = jaxamp.init(jaxamp_loss(scalar_net(FP16)), FP16, from_profile=False)(W, T)
    assert sorted(state.scales) == ["1", "2"]


def test_jax_grad_left_in_the_loss_is_scaled_per_order():
    """It was silent (AmpState(scales={}), every step skipped); the network boundary scales it."""
    u = scalar_net(FP16)
    loss = lambda w, t: jax.grad(jax.grad(u, 1), 1)(w, t) ** 2  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnscaledDerivativeWarning)
        state = jaxamp.init(loss, FP16)(W, T)
    assert sorted(state.scales) == ["1", "2"]


@pytest.mark.parametrize("amp", [FP16, AmpConfig(derivative_scaling=False), AmpConfig(dtype="bfloat16")])
def test_no_warning_without_a_derivative_or_without_derivative_scaling(amp):
    data_loss = lambda w, t: scalar_net(amp)(w, t) ** 2  # noqa: E731  (no derivative at all)
    grad_loss = lambda w, t: jax.grad(scalar_net(amp), 1)(w, t) ** 2  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxamp.init(data_loss, amp)(W, T)
        if not amp.scaler_enabled:  # plain fp16 / bf16: jax.grad is what the config asks for
            jaxamp.init(grad_loss, amp)(W, T)
        jaxamp.init(jaxamp_loss(scalar_net(amp)), amp, from_profile=False)(W, T)


# ---------------------------------------------------------------- the config is passed, never ambient
def test_autocast_without_amp_is_an_error_naming_the_fix():
    with pytest.raises(TypeError, match=r"autocast\(mlp\): `amp` is missing.*autocast\(fn, amp\)"):
        jaxamp.autocast(mlp)


def test_a_nested_autocast_is_checked_against_the_outer_config():
    same = jaxamp.autocast(lambda w, x: jaxamp.autocast(mlp, FP16)(w, x) @ w, FP16)
    closed = jax.make_jaxpr(same)(W, jnp.ones((3, 2)))
    assert [p.amp_dtype for p in policy.policies_in(closed)] == ["float16"] * 2
    clash = jaxamp.autocast(lambda w, x: jaxamp.autocast(mlp, FP16)(w, x) @ w, AmpConfig(dtype="bfloat16"))
    with pytest.raises(ConfigError, match=r"the config of autocast\(.*<lambda>\), which it runs in,.*'bfloat16'"):
        clash(W, jnp.ones((3, 2)))


def test_the_policy_module_holds_no_active_config():
    """The config reaches a program through the arguments of the call that traces it."""
    assert not any(hasattr(policy, name) for name in ("using", "active", "active_caller"))


def test_autocast_of_a_flax_module_names_model_apply():
    """It raised Flax's CallCompactUnboundModuleError at the first call."""
    with pytest.raises(TypeError, match=r"`fn`=Dense\(...\) is a Flax module.*autocast\(model.apply, amp\)"):
        jaxamp.autocast(nn.Dense(3), FP16)
