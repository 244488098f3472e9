"""Weight transfer Flax <-> torch state_dict, weight norm's (v, g) included: exact both ways."""

import numpy as np
import pytest
import torch

import jaxamp
import torch_ref
from tests.helpers.parity import build_pair


def test_round_trip_is_exact_and_shapes_follow_modulus():
    amp = jaxamp.AmpConfig(enabled=False)
    jm, params, tm = build_pair(amp, 2, 3, layer_size=8, nr_layers=2, seed=3)
    sd = torch_ref.flax_to_torch(params)
    assert sd["layers.0.linear.weight"].shape == (8, 2) and sd["layers.0.linear.weight_g"].shape == (8, 1)
    assert sd["final_layer.linear.weight"].shape == (3, 8) and "final_layer.linear.weight_g" not in sd
    assert set(sd) == set(tm.state_dict())
    back = torch_ref.torch_to_flax(tm.state_dict())["params"]
    for layer, leaves in params["params"].items():
        assert set(back[layer]) == set(leaves)
        for name, value in leaves.items():
            np.testing.assert_array_equal(back[layer][name], np.asarray(value))
            assert back[layer][name].dtype == np.float32
    # torch -> flax -> torch, with trained-looking (non-unit) g
    with torch.no_grad():
        tm.layers[1].linear.weight_g.uniform_(0.5, 2.0)
    again = torch_ref.flax_to_torch(torch_ref.torch_to_flax(tm.state_dict()))
    for k, v in tm.state_dict().items():
        assert torch.equal(again[k], v), k


def test_unknown_names_are_rejected_by_name():
    with pytest.raises(KeyError, match="conv"):
        torch_ref.torch_to_flax({"conv.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="dense_0"):
        torch_ref.flax_to_torch({"params": {"dense_0": {"kernel": np.zeros((1, 1))}}})


def test_shared_init_params_match_every_precision_configuration():
    """tests.helpers.parity.init_params shares one init across configurations: check that is sound."""
    import jax
    import jax.numpy as jnp

    from jaxamp.models import FullyConnected
    from tests.helpers.parity import init_params

    shared = init_params(1, 1, 8, 2, 5)
    amp = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True, autocast_activation=True)
    own_model = FullyConnected.from_amp(amp, out_features=1, layer_size=8, nr_layers=2, activation="tanh")
    own = jax.jit(own_model.init)(jax.random.PRNGKey(5), jnp.zeros(1))
    same = jax.tree_util.tree_map(lambda a, b: a.dtype == b.dtype and bool(jnp.array_equal(a, b)), shared, own)
    assert jax.tree_util.tree_structure(shared) == jax.tree_util.tree_structure(own)
    assert all(jax.tree_util.tree_leaves(same))


def test_scale_states_cross_exactly_and_bad_input_is_named():
    """torch_ref.scale_states_from_jax / scale_states_to_jax keep float32 scale and int32 tracker exactly."""
    import jax.numpy as jnp

    from jaxamp._src.scaling.scaler import ScaleState

    jax_states = {"1": ScaleState(jnp.float32(2.0**-126), jnp.int32(7)),
                  "u__x": ScaleState(jnp.float32(0.3), jnp.int32(0))}  # 0.3: not a power of two
    t = torch_ref.scale_states_from_jax(jax_states)
    assert t["1"].scale.dtype == torch.float32 and t["1"].growth_tracker.dtype == torch.int32
    assert float(t["1"].scale) == 2.0**-126 and int(t["1"].growth_tracker) == 7
    back = {k: ScaleState(**v) for k, v in torch_ref.scale_states_to_jax(t).items()}
    for k, s in jax_states.items():
        assert back[k].scale.dtype == np.float32 and back[k].growth_tracker.dtype == np.int32
        assert back[k].scale == s.scale and back[k].growth_tracker == s.growth_tracker
    with pytest.raises(TypeError, match="`states`"):
        torch_ref.scale_states_from_jax([1.0])
    with pytest.raises(TypeError, match="scaler state '2'"):
        torch_ref.scale_states_to_jax({"2": 1.0})
    with pytest.raises(KeyError, match="growth_tracker"):
        torch_ref.scale_states_from_jax({"2": {"scale": 1.0}})
