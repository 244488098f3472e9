"""Modulus-style fully connected network in Flax, with explicit precision placement.

Parameters are always float32. Each layer is told its compute dtype explicitly (Flax's
``dtype=None`` would silently promote float16 inputs with float32 params to float32).
"""

from __future__ import annotations

from typing import ClassVar, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.models.activations import ACTIVATIONS, apply_activation, check_activation
from jaxamp._src.placement.tensor_scale import scaled_dot
from jaxamp._src.placement.recompute import WEIGHT_CAST

__all__ = ["precision_fields", "WeightNormDense", "FullyConnected"]


def precision_fields(config: AmpConfig) -> dict:
    """The precision fields of a network module (``dtype``, ``fp32_first_layer``,
    ``fp32_activations``, ``matmul_formats``, ``tensor_scaling``) for ``config``: the
    ``autocast_*`` flags act for any reduced dtype; per-tensor scaling and FP8 as for autocast."""
    reduced = not config.off
    return dict(
        dtype=config.compute_dtype,
        matmul_formats=config.matmul_formats,
        tensor_scaling=config.tensor_scaling,
        fp32_first_layer=reduced and not config.autocast_firstlayer,
        fp32_activations=reduced and not config.autocast_activation,
    )


class WeightNormDense(nn.Module):
    """``y = x @ (g * v / ||v||) + b``, the norm per output unit (Modulus' WeightNormLinear).

    Float32 params ``kernel`` (Glorot-uniform), ``weight_g`` (ones, with weight norm) and ``bias``
    (zeros); the effective weight is built in float32, the matmul runs in ``dtype``, or, with
    ``matmul_formats`` (value, tangent, cotangent: float16 or FP8), as
    :func:`jaxamp._src.placement.tensor_scale.scaled_dot` (per-tensor scales when ``tensor_scaling``).
    """

    features: int
    weight_norm: bool = True
    dtype: jnp.dtype = jnp.float32
    matmul_formats: Optional[Tuple[str, str, str]] = None
    tensor_scaling: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.glorot_uniform(), (x.shape[-1], self.features), jnp.float32)
        if self.weight_norm:
            g = self.param("weight_g", nn.initializers.ones, (self.features,), jnp.float32)
            kernel = kernel * (g / jnp.linalg.norm(kernel, axis=0))
        bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        x = x.astype(self.dtype)
        if self.matmul_formats is not None and jnp.dtype(self.dtype) != jnp.float32:
            dims = (((x.ndim - 1,), (0,)), ((), ()))
            y = scaled_dot(x, kernel, dims, self.matmul_formats, scaling=self.tensor_scaling, out_dtype=self.dtype)
            return y + bias.astype(self.dtype)
        return jnp.dot(x, self._kernel(kernel)) + bias.astype(self.dtype)

    def _kernel(self, kernel: jax.Array) -> jax.Array:
        """``kernel`` in ``dtype``; a 16-bit cast named for the backward pass to keep (the bias's is
        recomputed: ``AmpConfig.recompute_float32``, ``jaxamp/_src/placement/recompute.py``)."""
        cast = kernel.astype(self.dtype)
        return checkpoint_name(cast, WEIGHT_CAST) if cast.dtype != kernel.dtype else cast


class FullyConnected(nn.Module):
    """Modulus Sym's FullyConnectedArch: ``nr_layers`` weight-normed hidden layers of
    ``layer_size`` units, then a plain linear output layer; float32 ``[..., out_features]`` out.

    Precision (see :meth:`from_amp`): layers compute in ``dtype``; ``fp32_first_layer`` keeps
    the first layer and its activation in float32; ``fp32_activations`` evaluates every
    activation in float32. ``skip_connections``: as Modulus, the output of every second hidden
    layer (0, 2, 4, ...) is added to the next such output.
    """

    # the activation names ``activation`` accepts
    activations: ClassVar[Tuple[str, ...]] = tuple(sorted(ACTIVATIONS))

    out_features: int
    layer_size: int = 512
    nr_layers: int = 6
    activation: str = "silu"
    skip_connections: bool = False
    weight_norm: bool = True
    dtype: jnp.dtype = jnp.float32
    matmul_formats: Optional[Tuple[str, str, str]] = None
    tensor_scaling: bool = False
    fp32_first_layer: bool = True
    fp32_activations: bool = True

    @classmethod
    def from_amp(cls, config: AmpConfig, out_features: int, **kwargs) -> "FullyConnected":
        """The network with the precision placement that ``config`` asks for."""
        return cls(out_features=out_features, **precision_fields(config), **kwargs)

    def _validate(self) -> None:
        check_activation(self.activation)
        for name in ("out_features", "layer_size", "nr_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FullyConnected: `{name}`={value!r} must be a positive integer.")
        if jnp.dtype(self.dtype) not in (jnp.float16, jnp.bfloat16, jnp.float32):
            raise ValueError(f"FullyConnected: `dtype`={self.dtype!r} must be float16, bfloat16 or float32.")

    def _matmul(self) -> Tuple[Optional[Tuple[str, str, str]], bool]:
        formats = None if self.matmul_formats is None else tuple(self.matmul_formats)
        return formats, self.tensor_scaling

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        self._validate()
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"FullyConnected: inputs must be floating point, got dtype {x.dtype}.")
        act_dtype: Optional[jnp.dtype] = jnp.float32 if self.fp32_activations else None
        x_skip = None
        for i in range(self.nr_layers):
            dtype = jnp.float32 if i == 0 and self.fp32_first_layer else self.dtype
            x = WeightNormDense(self.layer_size, self.weight_norm, dtype, *self._matmul(), name=f"layers_{i}")(x)
            x = apply_activation(self.activation, x, act_dtype).astype(self.dtype)
            if self.skip_connections and i % 2 == 0:
                x, x_skip = (x if x_skip is None else x + x_skip), x
        x = WeightNormDense(self.out_features, False, self.dtype, *self._matmul(), name="final_layer")(x)
        return x.astype(jnp.float32)
