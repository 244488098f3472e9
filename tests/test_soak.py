"""The fault-injection soak (:mod:`benchmarks.soak`): 9 % of the steps carry a NaN collocation
point, 1 % a batch whose second derivatives truly overflow float16.

The soak runs in a subprocess: its overflows are real float16 overflows, which needs
``XLA_FLAGS=--xla_allow_excess_precision=false`` set before JAX starts (the module sets it
when run as a script). Both soaks are slow tests (a subprocess compiles the whole step: about
15 s of CPU even for 300 steps); the fast suite checks the fault schedule.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxamp
from benchmarks import soak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_soak(tmp_path, steps, chunk):
    out = tmp_path / "soak.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--steps", str(steps), "--chunk", str(chunk),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def assert_soak_holds(proc, figures, steps):
    assert figures["steps"] == steps and figures["excess_precision_off"]
    assert figures["nan_steps"] >= 0.05 * steps and figures["overflow_steps"] >= 1
    assert figures["nonfinite_param_steps"] == 0
    assert figures["skipped_steps"] >= figures["nan_steps"] + figures["overflow_steps"]
    assert figures["skipped_bit_identical_pct"] == 100.0
    assert figures["nan_skipped_as_bad_values_pct"] == 100.0 and figures["nan_steps_scalers_unchanged_pct"] == 100.0
    assert figures["overflow_skipped_as_overflow_pct"] == 100.0  # real overflows, seen by the engine
    assert figures["overflow_steps_flagging_key"]["2"] == figures["overflow_steps"]
    assert figures["clean_steps_flagging_a_key"] == 0
    # a clean step is skipped only by the loss scaler (float16 weight gradients), never for values
    assert set(figures["clean_skip_reasons"]) <= {str(jaxamp.SkipReason.NONFINITE_GRADS)}
    assert min(figures["scale_log2_min_faulty"].values()) < 0  # the overflows did back a scaler off
    for key in soak.KEYS:
        assert abs(figures["scale_log2_faulty"][key] - figures["scale_log2_fault_free"][key]) <= 1.0
    assert figures["applied_faulty"] == figures["applied_fault_free"]
    assert 0.5 <= figures["final_loss_faulty"] / figures["final_loss_fault_free"] <= 2.0
    assert figures["bad_values_only_run_bit_identical_to_fault_free"]
    assert figures["failures"] == [] and soak.failures(figures) == []
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schedule_injects_one_nan_point_or_a_stretched_batch():
    plan = soak.schedule(2000, seed=1)
    nan, overflow = plan["nan"], plan["overflow"]
    assert not (nan & overflow).any() and 0.07 < nan.mean() < 0.11 and 0.003 < overflow.mean() < 0.02
    assert (np.isnan(plan["x"]).sum(axis=1) == nan).all()  # exactly one NaN point on a NaN step
    assert (plan["inv_length"][overflow] == soak.STRETCH).all() and (plan["inv_length"][~overflow] == 1.0).all()
    stretched = plan["x"][overflow] * soak.STRETCH  # what the network sees: still in [0, 1]
    assert stretched.min() >= 0.0 and stretched.max() <= 1.0 + 1e-6
    assert (plan["x"][~nan][:, -2:] * plan["inv_length"][~nan, None] == np.float32([0.0, 1.0])).all()


@pytest.mark.slow
def test_short_soak_keeps_every_promise(tmp_path):
    proc, figures = run_soak(tmp_path, steps=300, chunk=100)
    assert_soak_holds(proc, figures, 300)
    assert figures["applied_faulty"] <= 300 - figures["nan_steps"] - figures["overflow_steps"]


@pytest.mark.slow
def test_ten_thousand_step_soak_keeps_every_promise(tmp_path):
    proc, figures = run_soak(tmp_path, steps=10_000, chunk=500)
    assert_soak_holds(proc, figures, 10_000)
    assert figures["nan_steps"] > 800 and figures["overflow_steps"] > 50
