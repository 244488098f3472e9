"""Modulus Sym's FourierNet in Flax: fixed Fourier features of the inputs, then a FullyConnected.

The features ``[x, sin(2 pi x F), cos(2 pi x F)]`` (``F``: :func:`fourier_matrix`, not trained)
are computed in float32; the :class:`FullyConnected` behind them has the usual placement.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.scaling.config import AmpConfig
from jaxamp._src.models.fully_connected import FullyConnected

__all__ = ["FREQUENCY_KINDS", "DEFAULT_FREQUENCIES", "fourier_matrix", "FourierNet"]

FREQUENCY_KINDS = ("axis", "diagonal", "full", "gaussian")
DEFAULT_FREQUENCIES: Tuple = ("axis", tuple(range(10)))


def fourier_matrix(in_features: int, frequencies: Sequence, seed: int = 0) -> np.ndarray:
    """The fixed frequency matrix ``F`` (float32, ``[in_features, n]``) of a frequency spec.

    Specs (Modulus' names): ``("axis", fs)``: each frequency on each input axis alone
    (``n = len(fs) * in_features``); ``("diagonal", fs)``: each frequency on all axes at
    once (``n = len(fs)``); ``("full", fs)``: every combination of one frequency per axis
    (``n = len(fs) ** in_features``); ``("gaussian", sigma, n)``: ``n`` frequency vectors
    drawn from ``N(0, sigma^2)`` with numpy seed ``seed``.
    """
    if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 1:
        raise ValueError(f"fourier_matrix: `in_features`={in_features!r} must be a positive integer.")
    if not isinstance(frequencies, (tuple, list)) or not frequencies or frequencies[0] not in FREQUENCY_KINDS:
        raise ValueError(
            f"FourierNet: `frequencies`={frequencies!r} must be a tuple whose first entry is one of "
            f"{list(FREQUENCY_KINDS)}, e.g. ('axis', (0, 1, 2))."
        )
    kind = frequencies[0]
    if kind == "gaussian":
        if len(frequencies) != 3 or not float(frequencies[1]) > 0 or int(frequencies[2]) < 1:
            raise ValueError(
                f"FourierNet: `frequencies`={frequencies!r}: expected ('gaussian', sigma > 0, n >= 1)."
            )
        rng = np.random.default_rng(seed)
        return (rng.standard_normal((in_features, int(frequencies[2]))) * float(frequencies[1])).astype(np.float32)
    if len(frequencies) != 2 or not isinstance(frequencies[1], (tuple, list)) or not frequencies[1]:
        raise ValueError(f"FourierNet: `frequencies`={frequencies!r}: expected ({kind!r}, [f0, f1, ...]).")
    fs = [float(f) for f in frequencies[1]]
    if not all(math.isfinite(f) for f in fs):
        raise ValueError(f"FourierNet: `frequencies`={frequencies!r} must be finite numbers.")
    if kind == "axis":
        mat = np.zeros((in_features, len(fs) * in_features))
        for i in range(in_features):
            mat[i, i * len(fs) : (i + 1) * len(fs)] = fs
    elif kind == "diagonal":
        mat = np.tile(np.asarray(fs)[None, :], (in_features, 1))
    else:  # full
        mat = np.asarray(list(itertools.product(fs, repeat=in_features))).T
    return mat.astype(np.float32)


class FourierNet(FullyConnected):
    """FourierNet: ``FullyConnected([x, sin(2 pi x F), cos(2 pi x F)])``.

    Attributes as :class:`FullyConnected`, plus ``frequencies`` (a spec for
    :func:`fourier_matrix`, default ``("axis", (0, ..., 9))`` as Modulus) and
    ``frequency_seed`` (only for ``"gaussian"``). Build it with :meth:`from_amp`.
    """

    frequencies: Tuple = DEFAULT_FREQUENCIES
    frequency_seed: int = 0

    @classmethod
    def from_amp(cls, config: AmpConfig, out_features: int, **kwargs) -> "FourierNet":
        """The network with the precision placement that ``config`` asks for."""
        if "frequencies" in kwargs:
            kwargs["frequencies"] = _freeze(kwargs["frequencies"])
        return super().from_amp(config, out_features, **kwargs)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"FourierNet: inputs must be floating point, got dtype {x.dtype}.")
        x = x.astype(jnp.float32)
        freqs = jnp.asarray(fourier_matrix(x.shape[-1], self.frequencies, self.frequency_seed))
        phase = 2.0 * jnp.pi * jnp.matmul(x, freqs, precision=jax.lax.Precision.HIGHEST)
        features = jnp.concatenate([x, jnp.sin(phase), jnp.cos(phase)], axis=-1)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(FullyConnected) if f.init}
        fields.pop("parent", None), fields.pop("name", None)
        return FullyConnected(**fields, name="fc")(features)


def _freeze(spec):
    """Lists -> tuples, so the spec is hashable (a Flax module field)."""
    if isinstance(spec, (list, tuple)):
        return tuple(_freeze(s) for s in spec)
    return spec
