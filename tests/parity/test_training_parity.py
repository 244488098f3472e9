"""Training parity on the 1D Poisson PINN of tests/helpers/poisson_pair.py (same weights, points, Adam schedule).

- fp32, 200 steps, a NaN input point at the INJECT steps: losses agree to 1e-4 relative at
  every applied step; both skip exactly the NaN steps (non-finite gradients).
- fp16, 500 steps, derivative scalers active, both derivative keys flagged as overflowed at
  the INJECT steps: identical skip decisions and (scale, tracker) trajectories of every
  scaler and of the loss scaler; losses within FP16_LOSS_RTOL.
Overflow here is injected (a flag), so it does not depend on XLA's excess precision.
All are end-to-end training runs, so they run with -m slow (which CI runs); the shortest
runs the fp16 pair's first FAST_STEPS steps (the burst of injections, the backoffs, the
first recoveries).
The jitted jaxamp step is shared with test_checkpoint_parity.py (tests.helpers.poisson_pair.jax_side).
"""

import numpy as np
import pytest

import jaxamp
from tests.helpers.poisson_pair import fresh_pair, losses, run_jax, run_torch, trajectory

# Injected steps (fp32: a NaN input point; fp16: overflow flags). A burst of 8 backs the
# derivative scalers off to 2^-8.
# jaxamp seeds every point's derivative with its own copy of the scale (Derivatives.__call__),
# as torch's grad_outputs do: with one shared seed, the weight gradient stored the batch sum of
# the final layer's seed cotangent in float16 before multiplying by the seed, ~2^8 times larger
# than torch's, and at scales 2^-8 overflowed from loss scale 256 where torch_ref first
# overflows at 512 (measured on the step-48 params of this run); now both first overflow at 512.
INJECT = frozenset({40, 41, 42, 43, 44, 45, 46, 47, 200})
FP16_STEPS = 500
FP16_LOSS_RTOL = 6e-2  # measured max 4.8e-2 over the 500 steps, at step 499 (loss 43.6 -> 3.7e-3)
FAST_STEPS = 60


def _fp32_agree(steps: int):
    js, jstep, ts, tstep = fresh_pair("fp32")
    _, jm = run_jax(js, jstep, range(steps), frozenset(), nan=INJECT)
    tm = run_torch(ts, tstep, range(steps), frozenset(), nan=INJECT)
    jl, tl = losses(jm), losses(tm)
    skipped = np.array([m["skipped"] for m in tm])
    np.testing.assert_array_equal(np.array([m["skipped"] for m in jm]), skipped)
    injected = sorted(i for i in INJECT if i < steps)
    assert skipped[injected].all() and skipped.sum() == len(injected)  # fp32: non-finite grads skip
    assert (np.array([m["skip_reason"] for m in tm])[injected] == jaxamp.SkipReason.NONFINITE_GRADS).all()
    ok = ~skipped  # on injected steps both losses are NaN
    rel = np.abs(jl[ok] - tl[ok]) / np.abs(jl[ok])
    print(f"fp32: max loss rel diff {rel.max():.2e} at step {np.flatnonzero(ok)[rel.argmax()]}; "
          f"loss {jl[0]:.4g} -> {jl[-1]:.4g}")
    assert rel.max() < 1e-4
    return jl


@pytest.mark.slow
def test_fp32_training_losses_agree_to_1e_4():
    """lr 3e-4: at 1e-3 Adam drives the loss 43.6 -> 0.026 so fast that round-off differences grow
    to 1.1e-4 relative by step 108 (measured); at 3e-4 the trajectories stay within 1e-4."""
    jl = _fp32_agree(200)
    assert jl[-1] < 0.5 * jl[0]  # it trains


@pytest.mark.slow  # an end-to-end run (fast-suite budget); CI runs it
def test_fp32_training_losses_agree_to_1e_4_first_steps():
    _fp32_agree(FAST_STEPS)


def _fp16_runs(steps: int):
    js, jstep, ts, tstep = fresh_pair("fp16")
    _, jm = run_jax(js, jstep, range(steps), INJECT)
    tm = run_torch(ts, tstep, range(steps), INJECT)
    assert trajectory(jm) == trajectory(tm)
    skipped = np.array([m["skipped"] for m in tm])
    ok = ~skipped
    jl, tl = losses(jm), losses(tm)
    assert (np.abs(jl[ok] - tl[ok]) / np.abs(jl[ok])).max() < FP16_LOSS_RTOL
    return jm, tm


@pytest.mark.slow
def test_fp16_training_parity_first_steps():
    _, tm = _fp16_runs(FAST_STEPS)
    reasons = np.array([m["skip_reason"] for m in tm])
    assert set(np.flatnonzero(reasons)) == {i for i in INJECT if i < FAST_STEPS}
    assert (reasons[[i for i in INJECT if i < FAST_STEPS]] == jaxamp.SkipReason.DERIVATIVE_OVERFLOW).all()
    assert min(m["scale_log2/2"] for m in tm) == -8  # the burst backed off 8 times


@pytest.mark.slow
def test_fp16_training_parity():
    jm, tm = _fp16_runs(FP16_STEPS)
    skipped = np.array([m["skipped"] for m in tm])
    assert skipped.sum() == len(INJECT) and skipped[sorted(INJECT)].all()
    reasons = np.array([m["skip_reason"] for m in tm])
    assert (reasons[sorted(INJECT)] == jaxamp.SkipReason.DERIVATIVE_OVERFLOW).all()
    scales2 = np.array([m["scale_log2/2"] for m in tm])
    assert scales2.min() == -8 and scales2[199] == 0 and scales2[200] == -1  # 8 backoffs, recovered, again
    assert scales2[-1] == 0  # recovered to the max
    assert np.array([m["scale_log2/loss"] for m in tm]).max() == 4  # the loss scaler grew to its max
    ok = ~skipped
    jl, tl = losses(jm), losses(tm)
    rel = np.abs(jl[ok] - tl[ok]) / np.abs(jl[ok])
    print(f"fp16: {skipped.sum()} skipped; max loss rel diff {rel.max():.2e}; loss {jl[0]:.4g} -> {jl[-1]:.4g}")
    assert rel.max() < FP16_LOSS_RTOL
    assert jl[-1] < 0.01 * jl[0]  # it trains
