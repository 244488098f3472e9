"""FourierNet: Modulus' frequency layouts and the precision placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.models import FullyConnected
from jaxamp._src.models.fourier_net import FourierNet, fourier_matrix


def test_frequency_layouts():
    axis = fourier_matrix(2, ("axis", [0, 1, 2]))
    np.testing.assert_array_equal(axis, [[0, 1, 2, 0, 0, 0], [0, 0, 0, 0, 1, 2]])
    np.testing.assert_array_equal(fourier_matrix(2, ("diagonal", [1, 3])), [[1, 3], [1, 3]])
    assert fourier_matrix(2, ("full", [1, 2, 3])).shape == (2, 9)
    assert fourier_matrix(3, ("gaussian", 2.0, 5)).shape == (3, 5)
    with pytest.raises(ValueError, match="frequencies"):
        fourier_matrix(2, ("radial", [1]))


def test_features_then_fully_connected():
    """Output = FullyConnected([x, sin 2pi xF, cos 2pi xF]) with the same parameters."""
    amp = jaxamp.AmpConfig(enabled=False)
    net = FourierNet.from_amp(amp, 1, frequencies=("axis", (1, 2)), layer_size=8, nr_layers=2)
    x = jnp.array([0.3, -0.2])
    params = net.init(jax.random.PRNGKey(0), x)
    fc = FullyConnected.from_amp(amp, 1, layer_size=8, nr_layers=2)
    phase = 2 * np.pi * np.array([0.3, 0.6, -0.2, -0.4])
    feats = jnp.concatenate([x, jnp.sin(phase), jnp.cos(phase)]).astype(jnp.float32)
    want = fc.apply({"params": params["params"]["fc"]}, feats)
    np.testing.assert_allclose(net.apply(params, x), want, rtol=1e-6)


@pytest.mark.parametrize("firstlayer, first_dtype", [(False, jnp.float32), (True, jnp.float16)])
def test_precision_placement(firstlayer, first_dtype):
    amp = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=firstlayer)
    net = FourierNet.from_amp(amp, 1, layer_size=8, nr_layers=2)
    x = jnp.array([0.1, 0.2])
    params = net.init(jax.random.PRNGKey(0), x)
    text = jax.make_jaxpr(lambda p: net.apply(p, x))(params).pretty_print()
    sin_line = next(line for line in text.splitlines() if " sin " in line or "= sin" in line)
    assert "f32" in sin_line  # features always in float32
    dots = [line for line in text.splitlines() if "dot_general" in line]
    # dot 0: x @ F (features), dot 1: the first dense layer
    assert ("f16" in dots[1]) == (first_dtype == jnp.float16), dots[1]
    assert "f16" in dots[2]
    assert net.apply(params, x).dtype == jnp.float32
