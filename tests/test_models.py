import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.models import FullyConnected


def eqns(model, params, x, primitive):
    """Every equation of ``primitive`` in the forward graph, sub-jaxprs included, in order."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == primitive:
                out.append(e)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(jax.make_jaxpr(lambda p, x: model.apply(p, x))(params, x).jaxpr)
    return out


def make(amp, **kw):
    model = FullyConnected.from_amp(amp, out_features=3, layer_size=8, nr_layers=3, **kw)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))
    return model, params


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_params_are_f32_and_outputs_f32_for_every_dtype():
    for dtype in ("float16", "bfloat16", "float32"):
        model, params = make(jaxamp.AmpConfig(dtype=dtype))
        assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
        assert model.apply(params, jnp.ones((5, 2))).dtype == jnp.float32


def test_first_layer_in_fp32_unless_autocast_firstlayer():
    x = jnp.ones(2)
    model, params = make(jaxamp.AmpConfig(dtype="float16"))
    dots = eqns(model, params, x, "dot_general")
    assert [str(e.invars[0].aval.dtype) for e in dots] == ["float32", "float16", "float16", "float16"]
    model, params = make(jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True))
    dots = eqns(model, params, x, "dot_general")
    assert [str(e.invars[0].aval.dtype) for e in dots] == ["float16"] * 4


@pytest.mark.parametrize("autocast_activation, act_dtype", [(False, "float32"), (True, "float16")])
def test_activation_dtype_follows_autocast_activation(autocast_activation, act_dtype):
    model, params = make(jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True,
                                          autocast_activation=autocast_activation))
    sig = eqns(model, params, jnp.ones(2), "logistic")
    assert len(sig) == 3 and all(str(e.invars[0].aval.dtype) == act_dtype for e in sig)


def test_weight_norm_rows_have_norm_g_and_skip_connections_change_output():
    model = FullyConnected(out_features=1, layer_size=8, nr_layers=4)
    params = model.init(jax.random.PRNGKey(1), jnp.zeros(3))
    p = params["params"]["layers_1"]
    w = p["kernel"] * (p["weight_g"] / jnp.linalg.norm(p["kernel"], axis=0))
    np.testing.assert_allclose(jnp.linalg.norm(w, axis=0), p["weight_g"], rtol=1e-6)
    assert "weight_g" not in params["params"]["final_layer"]
    skip = FullyConnected(out_features=1, layer_size=8, nr_layers=4, skip_connections=True)
    x = jnp.ones((2, 3))
    assert not np.allclose(model.apply(params, x), skip.apply(params, x))
    # Modulus' rule: outputs of layers 0 and 2 are summed -> same as manual recomputation
    h = x
    outs = []
    for i in range(4):
        q = params["params"][f"layers_{i}"]
        h = jax.nn.silu(h @ (q["kernel"] * q["weight_g"] / jnp.linalg.norm(q["kernel"], axis=0)) + q["bias"])
        outs.append(h)
        if i == 2:
            h = h + outs[0]
    ref = h @ params["params"]["final_layer"]["kernel"] + params["params"]["final_layer"]["bias"]
    np.testing.assert_allclose(skip.apply(params, x), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw, fragment", [
    (dict(activation="relu6"), "activation='relu6' is not supported"),
    (dict(layer_size=0), "`layer_size`=0 must be a positive integer"),
    (dict(dtype=jnp.int8), "must be float16, bfloat16 or float32"),
])
def test_bad_model_settings(kw, fragment):
    model = FullyConnected(out_features=1, **kw)
    with pytest.raises((ValueError, TypeError)) as e:
        model.init(jax.random.PRNGKey(0), jnp.zeros(1))
    assert fragment in str(e.value)


@pytest.mark.parametrize("keys, formats, rtol", [
    ({"tensor_scaling": True}, {"float16"}, 0.01),
    ({"dtype": "float8", "float8_formats": {"tangent": "float8_e4m3fn"}}, {"float16", "float8_e4m3fn"}, 0.25),
])
def test_per_tensor_scaling_and_fp8_configs_reach_the_models_matmuls(keys, formats, rtol):
    amp = jaxamp.AmpConfig(**keys)
    net = FullyConnected.from_amp(amp, 1, layer_size=16, nr_layers=2, activation="tanh")
    plain = FullyConnected.from_amp(jaxamp.AmpConfig(), 1, layer_size=16, nr_layers=2, activation="tanh")
    x = jnp.array([[0.3, -0.2]])
    params = plain.init(jax.random.PRNGKey(0), x)
    u_x = lambda m: lambda p, x: jax.jvp(lambda x: m.apply(p, x), (x,), (jnp.ones_like(x),))[1]  # noqa: E731
    program = str(jax.make_jaxpr(u_x(net))(params, x))
    # the second hidden layer and the output layer, each for the values and their tangents; the
    # first layer stays float32
    assert program.count("jaxamp_scaled_dot") == 4 and program.count("role=tangent") == 2
    assert all(f in program for f in formats)
    assert "jaxamp_scaled_dot" not in str(jax.make_jaxpr(u_x(plain))(params, x))
    want = u_x(FullyConnected.from_amp(jaxamp.AmpConfig(enabled=False), 1, layer_size=16, nr_layers=2,
                                       activation="tanh"))(params, x)
    np.testing.assert_allclose(u_x(net)(params, x), want, rtol=rtol)
