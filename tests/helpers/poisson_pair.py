"""The 1D Poisson PINN of the training and checkpoint parity tests, in both frameworks.

u'' = -pi^2 sin(pi x) on [0, 1], u(0) = u(1) = 0; a 3x32 SiLU net with identical weights,
Adam on optax.exponential_decay(lr0, 100, 0.5) (torch: the same schedule fed the count of
applied updates), clip 0.5. One engine call per step covers the interior points and the two
boundary points (a single derivative graph: half of what two calls cost XLA to compile).

Three injections, the same in both frameworks: on the steps in ``nan`` one input point is NaN
(bad values); on the steps in ``inf_loss`` the source term is infinite (a non-finite loss no
derivative explains: bad values too); on the steps in ``inject`` both derivative scaler keys are
flagged as overflowed (an injected flag, so the scaler trajectories do not depend on XLA's excess
precision).

The jitted jaxamp step is built once per configuration and shared by every test that uses
it (:func:`jax_side`); torch models and optimizers are fresh on every :func:`fresh_pair`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxamp
import torch_ref
from jaxamp._src.derivatives.plan import mark_params
from jaxamp._src.core.marks import deriv_check
from tests.helpers.parity import NO_EXCESS, build_pair, torch_twin

N_INTERIOR = 32
X = np.linspace(0.0, 1.0, N_INTERIOR + 2, dtype=np.float32)[1:-1]
XB = np.array([0.0, 1.0], np.float32)

CONFIGS: Dict[str, Tuple[jaxamp.AmpConfig, float]] = {
    # name: (amp, initial learning rate)
    "fp32": (jaxamp.AmpConfig(enabled=False), 3e-4),
    "fp16": (jaxamp.AmpConfig(
        dtype="float16",
        derivative_scaler={"growth_interval": 20, "recover_growth_interval": 5},
        loss_scaler={"init_scale": 1.0, "max_scale": 16.0, "growth_interval": 40,
                     "recover_threshold": 0.5, "recover_growth_interval": 10}), 1e-3),
}


CLIP = 0.5  # Modulus' trainer: global-norm clipping of the unscaled weight gradients


def batch_at(step: int, inject: frozenset, nan: frozenset = frozenset(),
             inf_loss: frozenset = frozenset()) -> Dict[str, np.ndarray]:
    """Interior points, one extra point (NaN on the steps in ``nan``), then the two boundary
    points; ``overflow``: whether the derivative scaler keys are flagged (steps in ``inject``);
    ``source``: the source term's factor (inf on the steps in ``inf_loss``)."""
    extra = np.float32("nan") if step in nan else np.float32(0.5)
    return {"x": np.concatenate([X, [extra], XB]).astype(np.float32), "overflow": np.bool_(step in inject),
            "source": np.float32("inf") if step in inf_loss else np.float32(1.0)}


def schedule(lr0: float) -> Callable[[int], float]:
    """torch's twin of optax.exponential_decay(lr0, 100, 0.5), fed the count of applied updates."""
    return lambda count: lr0 * 0.5 ** (count / 100.0)


def inject_overflow(keys, overflow) -> None:
    """Flag every scaler key in ``keys`` as overflowed when ``overflow`` (bool[]): one marked
    check per key of an infinite derivative of a finite value, OR-ed by the step into that
    key's flag like the engine's own checks (no value and no bad-values flag changes). Inert
    where no scaler is active (float32: no keys)."""
    g = jnp.where(overflow, jnp.float32(jnp.inf), jnp.float32(0.0))
    for key in keys:
        deriv_check(g, jnp.float32(0.0), **mark_params(key))


def _jax_loss(je):
    def loss_fn(params, batch):
        d = je(params, {"x": batch["x"]})
        inject_overflow(je.scaler_keys, batch["overflow"])
        x = batch["x"][:-2]
        r = d["u__x__x"][:-2] + jnp.pi**2 * jnp.sin(jnp.pi * x) * batch["source"]
        pde, bc = jnp.mean(r**2), jnp.mean(d["u"][-2:] ** 2)
        return pde + bc, {"pde": pde, "bc": bc}

    return loss_fn


def _torch_loss(te):
    def loss_fn(model, batch, scales):
        d, found = te({"x": torch.from_numpy(batch["x"])}, scales)
        flag = torch.tensor(bool(batch["overflow"]))
        found = {k: v | flag if k != torch_ref.NONFINITE_VALUES else v for k, v in found.items()}
        x = torch.from_numpy(batch["x"][:-2])
        r = d["u__x__x"][:-2] + math.pi**2 * torch.sin(math.pi * x) * float(batch["source"])
        pde, bc = torch.mean(r**2), torch.mean(d["u"][-2:] ** 2)
        return pde + bc, ({"pde": pde, "bc": bc}, found)

    return loss_fn


@functools.lru_cache(maxsize=None)
def jax_side(config: str):
    """``(engine, optimizer, jitted step, initial flax params)`` for ``config``, built once."""
    amp, lr0 = CONFIGS[config]
    jm, params, _ = build_pair(amp, 1, 1, seed=0)
    je = jaxamp.Derivatives(lambda p, x: jm.apply(p, x), inputs=("x",), outputs=("u",),
                            derivatives=("u__x__x",), amp=amp, method="reverse")
    opt = optax.adam(optax.exponential_decay(lr0, 100, 0.5))
    step = jax.jit(jaxamp.make_train_step(_jax_loss(je), opt, amp=amp, grad_clip_max_norm=CLIP),
                   compiler_options=NO_EXCESS)
    return je, opt, step, params


def fresh_pair(config: str):
    """``(jax TrainState, jitted step, torch_ref TrainState, torch step)`` from identical weights."""
    amp, lr0 = CONFIGS[config]
    je, opt, jstep, params = jax_side(config)
    tm = torch_twin(amp, params, 1, 1)
    te = torch_ref.Derivatives(tm, inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=amp.to_dict())
    jstate = jaxamp.TrainState.create(params=params, optimizer=opt, amp=amp, engines=[je])
    tstate = torch_ref.TrainState.create(model=tm, optimizer=torch.optim.Adam(tm.parameters(), lr=lr0),
                                         amp=amp.to_dict(), engines=[te])
    return jstate, jstep, tstate, torch_ref.make_train_step(_torch_loss(te), lr_schedule=schedule(lr0),
                                                            grad_clip_max_norm=CLIP)


def run_jax(jstate, jstep, steps: range, inject: frozenset, nan: frozenset = frozenset(),
            inf_loss: frozenset = frozenset()):
    """Run ``jstep`` over ``steps``; returns (state, per-step metrics with trackers, as numpy)."""
    out = []
    with jax.default_matmul_precision("highest"):
        for i in steps:
            jstate, m = jstep(jstate, jax.tree_util.tree_map(jnp.asarray, batch_at(i, inject, nan, inf_loss)))
            out.append(dict(m, trackers={k: s.growth_tracker for k, s in jstate.amp_state.derivative.items()},
                            loss_tracker=jstate.amp_state.loss.growth_tracker))
    return jstate, jax.device_get(out)


def run_torch(tstate, tstep, steps: range, inject: frozenset, nan: frozenset = frozenset(),
              inf_loss: frozenset = frozenset()) -> List[dict]:
    out = []
    for i in steps:
        m = tstep(tstate, batch_at(i, inject, nan, inf_loss))
        out.append(dict(m, trackers={k: int(s.growth_tracker) for k, s in tstate.deriv_scales.items()},
                        loss_tracker=int(tstate.loss_scale.growth_tracker)))
    return out


def trajectory(ms: List[dict]) -> list:
    """Everything that must match exactly: skip decisions, reasons, every scale and tracker."""
    keys = sorted(k for k in ms[0] if k.startswith(("scale_log2/", "found_inf/")))
    return [(bool(m["skipped"]), int(m["skip_reason"]), int(m["loss_tracker"]),
             tuple(sorted((k, int(v)) for k, v in m["trackers"].items())),
             tuple(float(m[k]) for k in keys)) for m in ms]


def losses(ms: List[dict]) -> np.ndarray:
    return np.array([float(m["loss"]) for m in ms])
