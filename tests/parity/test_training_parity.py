"""Training parity on a 1D Poisson PINN: u'' = -pi^2 sin(pi x) on [0, 1], u(0) = u(1) = 0.

Same weights, fixed points, Adam with an exponential-decay schedule, clip 0.5.
- fp32, 200 steps: losses agree to 1e-4 relative at every step.
- fp16, 500 steps, derivative scalers active, a NaN input point injected at chosen steps:
  identical skip decisions and (scale, tracker) trajectories of every scaler and of the loss
  scaler; losses within FP16_LOSS_RTOL.
Both runs take minutes on a loaded 2-core machine, so they are marked slow.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxamp
import torch_ref
from parity_helpers import NO_EXCESS, build_pair

N_INTERIOR = 32
X = np.linspace(0.0, 1.0, N_INTERIOR + 2, dtype=np.float32)[1:-1]
XB = np.array([0.0, 1.0], np.float32)
INJECT = {40, 41, 42, 43, 44, 45, 46, 47, 300}  # steps where one input point is NaN
FP16_LOSS_RTOL = 5e-2  # measured max 3.2e-2 over 500 steps (loss 43.6 -> 3.5e-3; see test_fp16_training_parity)


def schedule(lr0):
    """torch's twin of optax.exponential_decay(lr0, 100, 0.5), fed the count of applied updates."""
    return lambda count: lr0 * 0.5 ** (count / 100.0)


def batch_at(step: int):
    extra = np.float32("nan") if step in INJECT else np.float32(0.5)
    return {"x": np.append(X, extra), "xb": XB}


def _jax_loss(je):
    def loss_fn(params, batch, scales):
        d, found = je(params, {"x": batch["x"]}, scales)
        r = d["u__x__x"] + jnp.pi**2 * jnp.sin(jnp.pi * batch["x"])
        ub, found_b = je(params, {"x": batch["xb"]}, scales)
        pde, bc = jnp.mean(r**2), jnp.mean(ub["u"] ** 2)
        return pde + bc, ({"pde": pde, "bc": bc}, jaxamp.merge_found_inf(found, found_b))

    return loss_fn


def _torch_loss(te):
    def loss_fn(model, batch, scales):
        x = torch.from_numpy(batch["x"])
        d, found = te({"x": x}, scales)
        r = d["u__x__x"] + math.pi**2 * torch.sin(math.pi * x)
        ub, found_b = te({"x": torch.from_numpy(batch["xb"])}, scales)
        pde, bc = torch.mean(r**2), torch.mean(ub["u"] ** 2)
        return pde + bc, ({"pde": pde, "bc": bc}, torch_ref.merge_found_inf(found, found_b))

    return loss_fn


def setup(amp: jaxamp.AmpConfig, lr0: float = 1e-3):
    jm, params, tm = build_pair(amp, 1, 1, seed=0)
    je = jaxamp.Derivatives(lambda p, x: jm.apply(p, x), inputs=("x",), outputs=("u",),
                            derivatives=("u__x__x",), amp=amp)
    te = torch_ref.Derivatives(tm, inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=amp.to_dict())
    opt = optax.adam(optax.exponential_decay(lr0, 100, 0.5))
    jstate = jaxamp.TrainState.create(params=params, optimizer=opt, amp=amp, engines=[je])
    jstep = jax.jit(jaxamp.make_train_step(_jax_loss(je), opt, amp=amp), compiler_options=NO_EXCESS)
    tstate = torch_ref.TrainState.create(model=tm, optimizer=torch.optim.Adam(tm.parameters(), lr=lr0),
                                         amp=amp.to_dict(), engines=[te])
    tstep = torch_ref.make_train_step(_torch_loss(te), lr_schedule=schedule(lr0))
    return jm, (jstate, jstep), (tstate, tstep)


def run_jax(jstate, jstep, steps, start=0):
    out = []
    with jax.default_matmul_precision("highest"):
        for i in range(start, start + steps):
            jstate, m = jstep(jstate, jax.tree_util.tree_map(jnp.asarray, batch_at(i)))
            out.append(dict(m, trackers={k: s.growth_tracker for k, s in jstate.deriv_scales.items()},
                            loss_tracker=jstate.loss_scale.growth_tracker))
    out = jax.device_get(out)
    return jstate, out


def run_torch(tstate, tstep, steps, start=0):
    out = []
    for i in range(start, start + steps):
        m = tstep(tstate, batch_at(i))
        out.append(dict(m, trackers={k: int(s.growth_tracker) for k, s in tstate.deriv_scales.items()},
                        loss_tracker=int(tstate.loss_scale.growth_tracker)))
    return out


def trajectory(ms):
    """Everything that must match exactly: skip decisions, reasons, every scale and tracker."""
    keys = sorted(k for k in ms[0] if k.startswith(("scale_log2/", "found_inf/")))
    return [(bool(m["skipped"]), int(m["skip_reason"]), int(m["loss_tracker"]),
             tuple(sorted((k, int(v)) for k, v in m["trackers"].items())),
             tuple(float(m[k]) for k in keys)) for m in ms]


@pytest.mark.slow
def test_fp32_training_losses_agree_to_1e_4():
    """lr 3e-4: at 1e-3 Adam drives the loss 43.6 -> 0.026 so fast that round-off differences grow
    to 1.1e-4 relative by step 108 (measured); at 3e-4 the trajectories stay within 1e-4."""
    _, (js, jstep), (ts, tstep) = setup(jaxamp.AmpConfig(enabled=False), lr0=3e-4)
    js, jm = run_jax(js, jstep, 200)
    tm = run_torch(ts, tstep, 200)
    jl, tl = np.array([m["loss"] for m in jm]), np.array([m["loss"] for m in tm])
    skipped = np.array([m["skipped"] for m in tm])
    np.testing.assert_array_equal(np.array([m["skipped"] for m in jm]), skipped)
    assert skipped[sorted(i for i in INJECT if i < 200)].all() and skipped.sum() == len([i for i in INJECT if i < 200])
    ok = ~skipped  # on injected steps both losses are NaN
    rel = np.abs(jl[ok] - tl[ok]) / np.abs(jl[ok])
    print(f"fp32: max loss rel diff {rel.max():.2e} at step {np.flatnonzero(ok)[rel.argmax()]}; loss {jl[0]:.4g} -> {jl[-1]:.4g}")
    assert rel.max() < 1e-4
    assert jl[-1] < 0.5 * jl[0]  # it trains


@pytest.fixture(scope="module")
def fp16_runs():
    amp = jaxamp.AmpConfig(dtype="float16", derivative_scaler={"growth_interval": 50, "recover_growth_interval": 10},
                           loss_scaler={"init_scale": 1.0, "max_scale": 16.0, "growth_interval": 100,
                                                        "recover_threshold": 0.5, "recover_growth_interval": 10})
    jmodel, (js, jstep), (ts, tstep) = setup(amp)
    js, jm = run_jax(js, jstep, 500)
    tm = run_torch(ts, tstep, 500)
    return dict(amp=amp, jm=jm, tm=tm)


@pytest.mark.slow
def test_fp16_training_parity(fp16_runs):
    jm, tm = fp16_runs["jm"], fp16_runs["tm"]
    assert trajectory(jm) == trajectory(tm)
    skipped = np.array([m["skipped"] for m in tm])
    assert skipped[sorted(INJECT)].all()
    reasons = np.array([m["skip_reason"] for m in tm])
    assert (reasons[sorted(INJECT)] == jaxamp.SKIP_DERIVATIVE_OVERFLOW).all()
    scales2 = np.array([m["scale_log2/2"] for m in tm])
    assert scales2.min() == -8 and scales2[-1] == 0  # backed off 8 times, recovered to the max
    assert np.array([m["scale_log2/loss"] for m in tm]).max() == 4  # the loss scaler grew to its max
    ok = ~skipped
    jl, tl = np.array([m["loss"] for m in jm]), np.array([m["loss"] for m in tm])
    rel = np.abs(jl[ok] - tl[ok]) / np.abs(jl[ok])
    print(f"fp16: {skipped.sum()} skipped; max loss rel diff {rel.max():.2e}; loss {jl[0]:.4g} -> {jl[-1]:.4g}")
    assert rel.max() < FP16_LOSS_RTOL
