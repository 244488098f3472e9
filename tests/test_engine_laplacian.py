"""The engine's Laplacian name ``"<output>__lap"``: :func:`jaxamp.laplacian` over ``laplacian_inputs``.

Oracles: ``jax.hessian``'s diagonal in float32 (the network and JAX's own derivatives); binary
scaling (scales ``2**k`` leave the value's bits unchanged on a float32 network); the same
program at scale 1 with ``derivative_scaling=False`` (bit-identical values and weight
gradients); overflows: a scale that takes the scaled sum out of float32's range, and a float16
network whose second derivatives leave float16, compiled with excess precision off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._src.core.marks import NONFINITE_VALUES
from tests.helpers.taylor import STRICT_FP16

INPUTS, OUTPUTS = ("t", "x", "y"), ("u", "v")


def params(seed=0, width=16):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"a": jax.random.normal(k[0], (3, width)), "b": 0.1 * jax.random.normal(k[1], (width,)),
            "c": jax.random.normal(k[2], (width, 2)) / 4.0}


def net(p, x, dtype=jnp.float32, k=1.0):
    h = jnp.tanh((k * x).astype(dtype) @ p["a"].astype(dtype) + p["b"].astype(dtype))
    return (jnp.sin(h) @ p["c"].astype(dtype)).astype(jnp.float32)


POINTS = jax.random.uniform(jax.random.PRNGKey(3), (6, 3), jnp.float32, -1.0, 1.0)
# the forward engine in the fast suite, the reverse engine too with -m slow
FAST_METHOD = ["forward", pytest.param("reverse", marks=pytest.mark.slow)]


def engine(amp=None, method="forward", **kw):
    return jaxamp.Derivatives(net, inputs=INPUTS, outputs=OUTPUTS, derivatives=("u__lap", "v__t"),
                              laplacian_inputs=("x", "y"), amp=amp, method=method, **kw)


@pytest.mark.parametrize("method", ["forward", "reverse"])
def test_value_is_the_hessian_diagonal_over_the_chosen_inputs(method):
    every = jaxamp.Derivatives(net, inputs=INPUTS, outputs=OUTPUTS, derivatives=("u__lap",), method=method)

    @jax.jit
    def run(p):
        hessians = jax.vmap(jax.hessian(lambda q: net(p, q)[0]))(POINTS)
        values, found = jaxamp.scaled(engine(method=method))({}, p, POINTS)
        return hessians, values, found, every(p, POINTS)["u__lap"]

    with jax.default_matmul_precision("highest"):
        hessians, values, found, lap_all = run(params())
    ref = hessians[:, 1, 1] + hessians[:, 2, 2]
    assert found == {} and sorted(values) == ["u", "u__lap", "v", "v__t"]
    np.testing.assert_allclose(values["u__lap"], ref, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(ref))))
    np.testing.assert_allclose(lap_all, jnp.trace(hessians, axis1=1, axis2=2), rtol=2e-5, atol=1e-5)


def test_keys_follow_the_scaler_mode():
    assert engine(jaxamp.AmpConfig()).scaler_keys == ("1", "2")
    assert engine(jaxamp.AmpConfig(mode="per_term_scaler")).scaler_keys == ("v", "u", "u__lap")
    assert engine(jaxamp.AmpConfig(derivative_scaling=False)).scaler_keys == ()
    amp = jaxamp.AmpConfig(mode="per_term_scaler")
    assert sorted(jaxamp.init(None, amp, keys=engine(amp).scaler_keys)().scales) == ["u", "u__lap", "v"]


@pytest.mark.parametrize("method", FAST_METHOD)
def test_binary_scales_leave_every_bit_and_a_huge_scale_flags_key_2(method):
    eng, p = engine(jaxamp.AmpConfig(), method), params()
    run = jax.jit(lambda s: jaxamp.scaled(eng)(s, p, POINTS))
    one, _ = run({"1": 1.0, "2": 1.0})
    for scales in ({"1": 2.0**-3, "2": 2.0**-9}, {"1": 2.0**6, "2": 2.0**-20}):
        values, found = run(scales)
        np.testing.assert_array_equal(values["u__lap"], one["u__lap"])
        assert not any(bool(v) for v in found.values())
    _, found = run({"1": 1.0, "2": 2.0**127})  # the scaled sum leaves float32
    assert {k: bool(v) for k, v in found.items()} == {"1": False, "2": True, NONFINITE_VALUES: False}


def test_float16_overflow_at_scale_1_and_none_at_a_small_scale():
    def net16(p, x):
        return net(p, x, jnp.float16, k=300.0)  # second derivatives ~ 300**2 leave float16

    eng = jaxamp.Derivatives(net16, inputs=INPUTS, outputs=OUTPUTS, derivatives=("u__lap",),
                             laplacian_inputs=("x", "y"), amp=jaxamp.AmpConfig())
    run = jax.jit(lambda s: jaxamp.scaled(eng)(s, params(), POINTS), compiler_options=STRICT_FP16)
    assert bool(run({"1": 1.0, "2": 1.0})[1]["2"])
    values, found = run({"1": 1.0, "2": 2.0**-12})
    assert not any(bool(v) for v in found.values()) and bool(jnp.all(jnp.isfinite(values["u__lap"])))


@pytest.mark.parametrize("method", FAST_METHOD)
def test_scale_1_is_bit_identical_to_derivative_scaling_off(method):
    scaled_eng, plain_eng = (engine(jaxamp.AmpConfig(), method),
                             engine(jaxamp.AmpConfig(derivative_scaling=False), method))

    def loss(eng, scales):
        def f(p):
            values, _ = jaxamp.scaled(eng)(scales, p, POINTS)
            return jnp.mean(values["u__lap"] ** 2 + values["v__t"] ** 2)

        return jax.jit(jax.value_and_grad(f))(params())

    a, b = loss(scaled_eng, {"1": 1.0, "2": 1.0}), loss(plain_eng, {})
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_bad_names_are_errors_naming_them():
    with pytest.raises(ValueError, match="'u__x__lap' is not allowed: a Laplacian is '<output>__lap'"):
        jaxamp.Derivatives(net, inputs=INPUTS, outputs=OUTPUTS, derivatives=("u__x__lap",))
    with pytest.raises(ValueError, match="'w'.*not an output"):
        jaxamp.Derivatives(net, inputs=INPUTS, outputs=OUTPUTS, derivatives=("w__lap",))
    with pytest.raises(ValueError, match=r"`laplacian_inputs` names \['z'\]"):
        jaxamp.Derivatives(net, inputs=INPUTS, outputs=OUTPUTS, derivatives=("u__lap",), laplacian_inputs=("x", "z"))
    # an input named "lap": u__lap is du/dlap, as Modulus names it
    eng = jaxamp.Derivatives(lambda p, x: x[:1] ** 2, inputs=("lap",), outputs=("u",), derivatives=("u__lap",))
    np.testing.assert_allclose(eng(None, jnp.array([[3.0]]))["u__lap"], [6.0])


def test_headroom_profile_and_masking_see_the_laplacian():
    eng, p = engine(jaxamp.AmpConfig(), mask_nonfinite_points=True), params()
    scales = {"1": 1.0, "2": 2.0**-4}
    values, _ = jaxamp.scaled(eng)(scales, p, POINTS)
    _, _, headroom = jaxamp.scaled(eng, headroom=True)(scales, p, POINTS)
    peak = float(jnp.max(jnp.abs(values["u__lap"])))  # key "2" guards only the Laplacian here
    assert float(headroom["2"]) == pytest.approx(np.log2(65504.0) - np.log2(peak * 2.0**-4), abs=1e-5)
    bad = POINTS.at[2, 1].set(jnp.nan)
    masked, found = jaxamp.scaled(eng)(scales, p, bad)
    assert float(masked["u__lap"][2]) == 0.0 and not any(bool(v) for v in found.values())
    np.testing.assert_array_equal(masked["u__lap"][3:], values["u__lap"][3:])
