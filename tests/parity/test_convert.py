"""Weight transfer Flax <-> torch state_dict, weight norm's (v, g) included: exact both ways."""

import numpy as np
import pytest
import torch

import jaxamp
import torch_ref
from parity_helpers import build_pair


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
