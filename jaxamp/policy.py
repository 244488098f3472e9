"""The precision policy: parameters float32, compute in the AMP dtype, outputs float32."""

from __future__ import annotations

import jax.numpy as jnp
import jmp

from jaxamp.config import AmpConfig


def get_policy(config: AmpConfig) -> jmp.Policy:
    """A jmp ``Policy`` for ``config``: params f32, compute f16/bf16 (f32 when AMP is off), outputs f32."""
    return jmp.Policy(
        param_dtype=jnp.float32,
        compute_dtype=config.compute_dtype,
        output_dtype=jnp.float32,
    )
