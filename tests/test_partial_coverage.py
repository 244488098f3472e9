"""jaxamp.init warns when a loss takes float16 derivatives that no scaler guards, beside scaled ones
or alone, naming each (order, mode, the function it differentiates) and the fix; and stays
silent where every float16 derivative is scaled (the network boundary, jaxamp.grad and its
siblings, the engine)."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp import UnscaledDerivativeWarning
from jaxamp.models import FullyConnected

AMP = jaxamp.AmpConfig()
MODEL = nn.Sequential([nn.Dense(8), jnp.tanh, nn.Dense(1)])
PARAMS = MODEL.init(jax.random.PRNGKey(0), jnp.zeros(1))
X = jnp.float32(0.3)
net = jaxamp.autocast(MODEL.apply, AMP)


def u(p, x):  # an autocast network: its derivatives cross the boundary, scaled
    return net(p, x[None])[0]


def hand_cast(p, x):  # the same network cast to float16 by hand
    w0, w1 = (p["params"][k]["kernel"].astype(jnp.float16) for k in ("layers_0", "layers_2"))
    return (jnp.tanh(x[None].astype(jnp.float16) @ w0) @ w1)[0].astype(jnp.float32)


FLAX16 = nn.Sequential([nn.Dense(8, dtype=jnp.float16), jnp.tanh, nn.Dense(1, dtype=jnp.float16)])


def flax_dtype(p, x):  # a Flax network whose layers compute in float16 (dtype=), not autocast
    return FLAX16.apply(p, x[None])[0].astype(jnp.float32)


def captured(p, x):  # autocast holding the input as a captured array: a parameter to it
    return jaxamp.autocast(lambda q: MODEL.apply(q, x[None])[0], AMP)(p)


FC = FullyConnected.from_amp(AMP, out_features=1, layer_size=8, nr_layers=2)
FC_PARAMS = FC.init(jax.random.PRNGKey(0), jnp.zeros(1))
ENGINE = jaxamp.Derivatives(lambda q, x: FC.apply(q, x), inputs=("x",), outputs=("u",), derivatives=("u__x__x",),
                            amp=AMP, method="reverse")


def fc(q, x):  # jaxamp.models' float16 network (explicit placement, no autocast)
    return FC.apply(q, x[None])[0]


def d2(grad, f):
    return grad(grad(f, 1), 1)


SCALED = {
    "jax.grad of autocast": (lambda p, x: d2(jax.grad, u)(p, x), PARAMS),
    "jax.hessian of autocast": (lambda p, x: jax.hessian(u, 1)(p, x), PARAMS),
    "jaxamp.grad of a hand cast": (lambda p, x: d2(jaxamp.grad, hand_cast)(p, x) + jax.grad(u, 1)(p, x), PARAMS),
    "jaxamp.hessian of a hand cast": (lambda p, x: jaxamp.hessian(hand_cast, 1)(p, x), PARAMS),
    "jaxamp.jacfwd of a hand cast": (lambda p, x: jaxamp.jacfwd(hand_cast, 1)(p, x), PARAMS),
    "a hand cast forward pass only": (lambda p, x: hand_cast(p, x) + d2(jax.grad, u)(p, x), PARAMS),
    "jaxamp.grad of FullyConnected": (lambda q, x: d2(jaxamp.grad, fc)(q, x), FC_PARAMS),
    "the reverse engine": (lambda q, x: ENGINE(q, {"x": x[None]})["u__x__x"].sum(), FC_PARAMS),
}

UNSCALED = {  # name: (loss, params, what the warning names, whether a scaled derivative sits beside it)
    "jax.grad of a hand cast": (lambda p, x: d2(jax.grad, hand_cast)(p, x) + jax.grad(u, 1)(p, x), PARAMS,
                                [r"an order-2 derivative \(reverse mode\) of hand_cast \(.*test_partial_coverage.py"],
                                True),
    "jax.jacfwd of a hand cast": (lambda p, x: d2(jax.jacfwd, hand_cast)(p, x) + jax.grad(u, 1)(p, x), PARAMS,
                                  [r"an order-2 derivative \(forward mode\) of hand_cast"], True),
    "jax.jvp of a hand cast": (lambda p, x: jax.jvp(lambda t: hand_cast(p, t), (x,), (1.0,))[1], PARAMS,
                               [r"an order-1 derivative \(forward mode\) of hand_cast"], False),
    "a Flax dtype=float16 network": (lambda p, x: jax.grad(flax_dtype, 1)(p, x) + jax.grad(u, 1)(p, x), PARAMS,
                                     [r"an order-1 derivative \(reverse mode\) of flax_dtype"], True),
    "an autocast input captured as a parameter": (
        lambda p, x: jax.grad(captured, 1)(p, x) + d2(jax.grad, u)(p, x), PARAMS,
        [r"an order-1 derivative \(reverse mode\) of captured"], True),
    "jax.grad of FullyConnected beside jaxamp.grad": (
        lambda q, x: d2(jax.grad, fc)(q, x) + d2(jaxamp.grad, fc)(q, x), FC_PARAMS,
        [r"an order-2 derivative \(reverse mode\) of fc"], True),
    "two networks, each named": (
        lambda p, x: d2(jax.grad, hand_cast)(p, x) + jax.grad(flax_dtype, 1)(p, x) + jax.grad(u, 1)(p, x), PARAMS,
        [r"an order-1 derivative \(reverse mode\) of flax_dtype",
         r"an order-2 derivative \(reverse mode\) of hand_cast"],
        True),
}


@pytest.mark.parametrize("name", list(SCALED))
def test_no_warning_where_every_float16_derivative_is_scaled(name):
    loss, params = SCALED[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnscaledDerivativeWarning)
        state = jaxamp.init(loss, AMP, from_profile=False)(params, X)
    assert state.scales  # and the scaled ones have their keys


@pytest.mark.parametrize("name", list(UNSCALED))
def test_unscaled_float16_derivatives_warn_naming_each_and_the_fix(name):
    loss, params, named, beside = UNSCALED[name]
    with pytest.warns(UnscaledDerivativeWarning) as record:
        state = jaxamp.init(loss, AMP, from_profile=False)(params, X)
    (message,) = [str(w.message) for w in record if w.category is UnscaledDerivativeWarning]
    for pattern in named:
        assert len(re.findall(pattern, message)) == 1, (pattern, message)
    assert message.count("derivative (") == len(named)  # each named once, nothing else
    assert ("beside the scaled ones (keys " in message) == beside and bool(state.scales) == beside
    assert "Fix: place each such network with jaxamp.autocast(fn, amp)" in message
    assert record[0].filename == __file__  # points at the caller of init


def test_per_term_keys_leave_jax_grad_through_autocast_unscaled_and_say_so():
    """Per-term keys need names: autocast keeps no boundary, a jax.grad through it is unscaled."""
    amp = jaxamp.AmpConfig(mode="per_term_scaler")
    v = jaxamp.autocast(MODEL.apply, amp)
    w = lambda p, x: v(p, x[None])[0]  # noqa: E731
    loss = lambda p, x: jaxamp.grad(w, 1, of="u", wrt="x")(p, x) + d2(jax.grad, w)(p, x)  # noqa: E731
    with pytest.warns(UnscaledDerivativeWarning, match=r"beside the scaled ones \(keys \['u'\]\): an order-2 "
                                                        r"derivative \(reverse mode\) of \S*<lambda>"):
        state = jaxamp.init(loss, amp, from_profile=False)(PARAMS, X)
    assert sorted(state.scales) == ["u"]


def test_no_warning_without_derivative_scaling():
    loss = lambda p, x: d2(jax.grad, hand_cast)(p, x)  # noqa: E731
    for amp in (jaxamp.AmpConfig(derivative_scaling=False), jaxamp.AmpConfig(dtype="bfloat16")):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnscaledDerivativeWarning)
            jaxamp.init(loss, amp, from_profile=False)(PARAMS, X)
