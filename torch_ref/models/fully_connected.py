"""Modulus' FullyConnectedArch in torch, with jaxamp's explicit precision placement.

Op for op the same dtypes as ``jaxamp/models/fully_connected.py``:

- parameters are float32; the weight-normed weight ``g * v / ||v||`` is built in float32;
- a layer casts its input, weight and bias to its compute dtype, runs the matmul
  (``x @ W.T``, *not* ``addmm``: the bias is added after the product is rounded, as
  ``jnp.dot(x, k) + b`` does) and adds the bias in that dtype;
- ``fp32_first_layer``: the first layer computes in float32 and its activation runs in
  float32, then casts to the compute dtype;
- ``fp32_activations``: every other activation upcasts to float32, activates, casts back;
- the output is cast to float32.

State-dict names follow Modulus: ``layers.{i}.linear.weight`` ``[out, in]``,
``layers.{i}.linear.weight_g`` ``[out, 1]``, ``layers.{i}.linear.bias``,
``final_layer.linear.weight`` / ``.bias``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from torch_ref.config import DTYPES, as_settings

ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # silu as x * sigmoid(x), the expression jax.nn.silu differentiates
    "silu": lambda x: x * torch.sigmoid(x),
    "tanh": torch.tanh,
    "sin": torch.sin,
    "identity": lambda x: x,
}


def apply_activation(name: str, x: torch.Tensor, eval_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``act(x)`` evaluated in ``eval_dtype`` and cast back to ``x.dtype`` (None: in ``x``'s dtype)."""
    fn = ACTIVATIONS[name]
    if eval_dtype is None or eval_dtype == x.dtype:
        return fn(x)
    return fn(x.to(eval_dtype)).to(x.dtype)


class WeightNormLinear(nn.Module):
    """``y = x @ (g * v / ||v||).T + b`` with the norm per output row; the matmul in ``dtype``."""

    def __init__(self, in_features: int, out_features: int, weight_norm: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_g = nn.Parameter(torch.ones(out_features, 1)) if weight_norm else None
        self.bias = nn.Parameter(torch.zeros(out_features))
        bound = math.sqrt(6.0 / (in_features + out_features))  # Glorot uniform, as jaxamp
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight
        if self.weight_g is not None:
            w = w * (self.weight_g / torch.linalg.vector_norm(w, dim=1, keepdim=True))
        x = x.to(dtype)
        return torch.matmul(x, w.to(dtype).t()) + self.bias.to(dtype)


class FullyConnected(nn.Module):
    """Hidden layers of ``layer_size`` units (weight norm), activation, plain linear output layer.

    ``skip_connections``: as Modulus/jaxamp, every second hidden layer's output is added to the next.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        layer_size: int = 512,
        nr_layers: int = 6,
        activation: str = "silu",
        skip_connections: bool = False,
        weight_norm: bool = True,
        dtype: torch.dtype = torch.float32,
        fp32_first_layer: bool = True,
        fp32_activations: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features),
                            ("layer_size", layer_size), ("nr_layers", nr_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FullyConnected: `{name}`={value!r} must be a positive integer.")
        if activation not in ACTIVATIONS:
            raise ValueError(f"FullyConnected: `activation`={activation!r} must be one of {sorted(ACTIVATIONS)}.")
        if dtype not in DTYPES.values():
            raise ValueError(f"FullyConnected: `dtype`={dtype!r} must be torch.float16, bfloat16 or float32.")
        self.activation = activation
        self.skip_connections = skip_connections
        self.dtype = dtype
        self.fp32_first_layer = fp32_first_layer
        self.fp32_activations = fp32_activations
        sizes = [in_features] + [layer_size] * nr_layers
        self.layers = nn.ModuleList(
            nn.Module() for _ in range(nr_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.linear = WeightNormLinear(sizes[i], sizes[i + 1], weight_norm)
        self.final_layer = nn.Module()
        self.final_layer.linear = WeightNormLinear(layer_size, out_features, weight_norm=False)

    @classmethod
    def from_amp(cls, amp: Any, in_features: int, out_features: int, **kwargs) -> "FullyConnected":
        """The network with the precision placement an amp config (AmpSettings / mapping) asks for."""
        cfg = as_settings(amp)
        reduced = cfg.compute_dtype != torch.float32
        return cls(
            in_features,
            out_features,
            dtype=cfg.compute_dtype,
            fp32_first_layer=reduced and not cfg.autocast_firstlayer,
            fp32_activations=reduced and not cfg.autocast_activation,
            **kwargs,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            raise TypeError(f"FullyConnected: inputs must be floating point, got dtype {x.dtype}.")
        act_dtype = torch.float32 if self.fp32_activations else None
        x_skip = None
        for i, layer in enumerate(self.layers):
            if i == 0 and self.fp32_first_layer:
                x = layer.linear(x.to(torch.float32), torch.float32)
                x = apply_activation(self.activation, x, None).to(self.dtype)
            else:
                x = layer.linear(x, self.dtype)
                x = apply_activation(self.activation, x, act_dtype)
            if self.skip_connections and i % 2 == 0:
                if x_skip is not None:
                    x, x_skip = x + x_skip, x
                else:
                    x_skip = x
        x = self.final_layer.linear(x, self.dtype)
        return x.to(torch.float32)
