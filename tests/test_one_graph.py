"""One graph: the unscaled derivative engine is the scaled engine with every scale 1 and no checks.

A worker (:mod:`tests.helpers.one_graph`) runs in a subprocess with
``XLA_FLAGS=--xla_allow_excess_precision=false`` set before JAX initialises, so that every
float16 operation rounds to float16. For jaxamp's default placement (``AmpConfig()``) and an
all-float16 one (``autocast_activation`` and ``autocast_firstlayer``), a 3x32 tanh network, 32
points in [-1, 1]^d, the cavity's derivatives (u, v, p of x, y to order 2, one mixed) and a
4th-order pure derivative, with the forward and the reverse engine:

- every scale 1: derivative values and weight gradients (``jax.grad`` of a loss of the
  values) are bit-identical to the unscaled engine's;
- every scale 2^-1 .. 2^-4 (nothing overflows or leaves float16's normal range there):
  bit-identical after unscaling, since binary scaling commutes with rounding;
- ``make_train_step`` with ``AmpConfig()`` (derivative scales 1) and with
  ``AmpConfig(derivative_scaling=False)``: params, optimizer state and loss bit-identical over
  3 steps.

With XLA's default flags (excess precision allowed) the same cases were measured identical as
well (:func:`test_what_holds_with_default_xla_flags`): both engines compile to the same graph,
so XLA makes the same fusion and precision choices in both.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(xla_flags: str) -> dict:
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "tests.helpers.one_graph"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1800)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def strict():
    return run_worker("--xla_allow_excess_precision=false")


def engine_cases(results):
    return {k: v for k, v in results.items() if k.count("/") == 3}


def test_every_case_ran(strict):
    cases = engine_cases(strict)
    assert len(cases) == 2 * 2 * 2 * 5  # methods x placements x problems x scales
    for name, case in cases.items():  # the comparison is not vacuous: finite values, nothing flagged
        assert case["finite"] and case["flagged"] == [] and case["n_grads"] > 0, name


@pytest.mark.parametrize("log2_scale", [0, -1, -2, -3, -4])
def test_scaled_engine_is_bit_identical_to_unscaled(strict, log2_scale):
    cases = {k: v for k, v in engine_cases(strict).items() if k.endswith(f"/{log2_scale}")}
    assert cases
    diffs = {k: (v["values_diff"], v["grads_diff"]) for k, v in cases.items() if v["values_diff"] or v["grads_diff"]}
    assert diffs == {}


@pytest.mark.parametrize("placement", ["default", "fp16"])
def test_train_step_with_scales_one_is_bit_identical_to_no_derivative_scaling(strict, placement):
    case = strict[f"train/{placement}"]
    assert (case["params_diff"], case["opt_state_diff"], case["loss_diff"]) == (0, 0, 0), case
    assert len(set(case["losses"])) == 3  # the steps were applied


@pytest.mark.slow
def test_what_holds_with_default_xla_flags():
    default = run_worker("")
    diffs = {k: v for k, v in engine_cases(default).items() if v["values_diff"] or v["grads_diff"]}
    assert diffs == {}
    for placement in ("default", "fp16"):
        case = default[f"train/{placement}"]
        assert (case["params_diff"], case["opt_state_diff"], case["loss_diff"]) == (0, 0, 0), case
