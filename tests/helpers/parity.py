"""Shared builders for the parity tests: the same network, weights and points in both frameworks."""

from __future__ import annotations

import functools
import weakref
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxamp
import torch_ref
from jaxamp.models import FullyConnected as JaxFC
from torch_ref.models import FullyConnected as TorchFC

U16 = 2.0**-11  # float16 unit roundoff
NO_EXCESS = {"xla_allow_excess_precision": False}  # XLA rounds every f16 op, as torch does


def build_pair(amp: jaxamp.AmpConfig, n_in: int, n_out: int, *, layer_size: int = 32, nr_layers: int = 3,
               seed: int = 0, activation: str = "silu"):
    """(jax model, flax params, torch model) with identical float32 weights."""
    jm = JaxFC.from_amp(amp, out_features=n_out, layer_size=layer_size, nr_layers=nr_layers, activation=activation)
    params = init_params(n_in, n_out, layer_size, nr_layers, seed)
    return jm, params, torch_twin(amp, params, n_in, n_out, layer_size=layer_size, nr_layers=nr_layers,
                                  activation=activation)


@functools.lru_cache(maxsize=None)
def init_params(n_in: int, n_out: int, layer_size: int, nr_layers: int, seed: int):
    """Flax params of a ``FullyConnected``, initialised once per shape and seed (jitted).

    Parameters are float32 whatever the compute dtype, activation or precision placement, so
    every configuration of one shape shares them (a test checks this holds)."""
    jm = JaxFC(out_features=n_out, layer_size=layer_size, nr_layers=nr_layers)
    return jax.jit(jm.init)(jax.random.PRNGKey(seed), jnp.zeros(n_in))


def torch_twin(amp: jaxamp.AmpConfig, params, n_in: int, n_out: int, *, layer_size: int = 32, nr_layers: int = 3,
               activation: str = "silu") -> TorchFC:
    """A fresh torch_ref network holding the float32 weights of the Flax ``params``."""
    tm = TorchFC.from_amp(amp.to_dict(), n_in, n_out, layer_size=layer_size, nr_layers=nr_layers, activation=activation)
    tm.load_state_dict(torch_ref.flax_to_torch(params))
    return tm


def engines(jm, tm, amp, inputs: Sequence[str], outputs: Sequence[str], derivatives: Sequence[str]):
    je = jaxamp.Derivatives(lambda p, x: jm.apply(p, x), inputs=inputs, outputs=outputs,
                            derivatives=derivatives, amp=amp, method="reverse")  # torch's path
    te = torch_ref.Derivatives(tm, inputs=inputs, outputs=outputs, derivatives=derivatives, amp=amp.to_dict())
    return je, te


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """``||a - b|| / ||a||`` (2-norm over the points)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


_JITTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def evaluate(je, te, params, points: np.ndarray, scales: dict) -> Tuple[dict, dict, dict, dict]:
    """Values and flags from both engines at ``points`` with ``scales`` ({key: float})."""
    f = _JITTED.get(je)
    if f is None:  # one compilation per engine: scales are traced, so new scales do not recompile
        f = _JITTED[je] = jax.jit(lambda p, x, s: jaxamp.scaled(je)(s, p, x), compiler_options=NO_EXCESS)
    with jax.default_matmul_precision("highest"):
        dj, fj = f(params, jnp.asarray(points), {k: jnp.float32(v) for k, v in scales.items()})
    dt, ft = te(torch.from_numpy(points), {k: torch.tensor(v, dtype=torch.float32) for k, v in scales.items()})
    dj = {k: np.asarray(v) for k, v in dj.items()}
    dt = {k: v.detach().numpy() for k, v in dt.items()}
    return dj, {k: bool(v) for k, v in fj.items()}, dt, {k: bool(v) for k, v in ft.items()}
