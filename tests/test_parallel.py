"""Data-parallel training (jaxamp.parallel): one global skip decision on every device.

The multi-device checks need 8 fake CPU devices, which must be requested before JAX starts,
so they run in subprocesses (tests/parallel_worker.py with
XLA_FLAGS=--xla_force_host_platform_device_count=8); the float32 and float16 halves run at
the same time, one per core. This process only runs the argument checks on whatever devices
it has. Bad values (a NaN collocation point) and derivative overflows (a flag raised at one
point) are *injected*, so nothing depends on XLA keeping excess precision.

The worker runs are end-to-end (``-m slow``): 1 against 8 devices, and the 2-device mesh
(one more worker per dtype) against the same 1-device trajectories. The fast suite runs the
argument checks in this process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxamp
from jaxamp._src.training import parallel

WORKER = Path(__file__).with_name("parallel_worker.py")
STEPS = 100


def _run_workers(devices: str) -> Dict[str, Any]:
    """parallel_worker.py's fp32 and fp16 halves at the same time (one per core), merged."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--steps", str(STEPS), "--part", part, "--devices", devices],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for part in ("fp32", "fp16")
    ]
    result: Dict[str, Any] = {}
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, f"parallel_worker.py failed (rc {p.returncode}):\n{err[-4000:]}"
        result.update(json.loads(out.strip().splitlines()[-1]))
    assert result["device_count"] == 8
    return result


@pytest.fixture(scope="module")
def worker() -> Dict[str, Any]:
    return _run_workers("1,8")


def _check_fp32_same(runs: Dict[str, Any], base_runs: Dict[str, Any], n: str) -> None:
    base = np.array(base_runs["1"]["loss"])
    assert base.shape == (STEPS,) and np.all(np.isfinite(base))
    assert base[-1] < 0.5 * base[0], "the run must actually train for the comparison to mean anything"
    loss = np.array(runs[n]["loss"])
    np.testing.assert_allclose(loss, base, rtol=1e-5, err_msg=f"{n} devices vs 1")
    assert not any(runs[n]["skipped"])
    assert runs[n]["replicas_identical"] == [True]


def _check_fp16_same(runs: Dict[str, Any], base_runs: Dict[str, Any], n: str) -> None:
    base = base_runs["1"]
    keys = [k for k in base if k.startswith(("scale_log2/", "found_inf/"))
            or k in ("skipped", "skip_reason", "found_nonfinite_values")]
    assert {"scale_log2/loss", "scale_log2/1", "scale_log2/2", "found_nonfinite_values"} <= set(keys)
    reasons, s2 = base["skip_reason"], base["scale_log2/2"]
    # The trajectory exercises every branch: growth, bad values (NaN point at steps 20, 21: no
    # scaler changes), derivative overflow of key "2" (flag at steps 30, 31: two backoffs) and
    # real weight-gradient overflow of the growing loss scale.
    assert reasons[20] == reasons[21] == jaxamp.SkipReason.NONFINITE_VALUES
    assert base["scale_log2/1"][19:22] == [base["scale_log2/1"][19]] * 3 and s2[19:22] == [s2[19]] * 3
    assert reasons[30] == reasons[31] == jaxamp.SkipReason.DERIVATIVE_OVERFLOW and s2[31] == s2[29] - 2
    assert jaxamp.SkipReason.NONFINITE_GRADS in reasons and len(set(base["scale_log2/1"])) == 3
    for k in keys:
        assert runs[n][k] == base[k], f"{k} differs between {n} devices and 1"
    assert runs[n]["replicas_identical"] == [True]
    # fp16 losses agree loosely (reduction order differs); the decisions above agree exactly.
    a, b = np.array(runs[n]["loss"]), np.array(base["loss"])
    ok = np.isfinite(b)
    np.testing.assert_array_equal(np.isfinite(a), ok)
    np.testing.assert_allclose(a[ok], b[ok], rtol=1e-3)


@pytest.mark.slow  # end-to-end runs on 8 (2 x 2) fake devices in subprocesses
def test_fp32_loss_trajectory_same_on_1_and_8_devices(worker):
    _check_fp32_same(worker["float32"], worker["float32"], "8")


@pytest.mark.slow  # end-to-end runs on 8 (2 x 2) fake devices in subprocesses
def test_fp16_scaler_trajectories_identical_on_1_and_8_devices(worker):
    _check_fp16_same(worker["float16"], worker["float16"], "8")


@pytest.mark.slow
def test_fp32_and_fp16_trajectories_on_2_devices_follow_1_device(worker):
    two = _run_workers("2")
    _check_fp32_same(two["float32"], worker["float32"], "2")
    _check_fp16_same(two["float16"], worker["float16"], "2")


@pytest.mark.slow  # end-to-end runs on 8 (2 x 2) fake devices in subprocesses
def test_bad_values_on_one_shard_skip_everywhere_and_change_no_scaler(worker):
    r = worker["inject"]["nan"]
    assert r["bad_devices"] == [5], "the NaN point must land on exactly one device's shard"
    assert r["skipped"] and r["skip_reason"] == jaxamp.SkipReason.NONFINITE_VALUES and r["found_nonfinite_values"]
    assert r["params_unchanged"] and r["opt_state_unchanged"] and r["loss_scale_unchanged"]
    assert r["deriv_scales_after"] == r["deriv_scales_before"]
    assert r["replicas_identical_after_skip"]
    assert not r["next_step_skipped"] and r["params_changed_after_next"] and r["replicas_identical_after_next"]


@pytest.mark.slow  # end-to-end runs on 8 (2 x 2) fake devices in subprocesses
def test_overflow_on_one_shard_skips_everywhere(worker):
    r = worker["inject"]["overflow"]
    assert r["bad_devices"] == [5], "the overflow flag must be raised in exactly one device's shard"
    assert r["skipped"] and r["skip_reason"] == jaxamp.SkipReason.DERIVATIVE_OVERFLOW
    assert r["found_inf"] == {"1": False, "2": True} and not r["found_nonfinite_values"]
    assert r["params_unchanged"] and r["opt_state_unchanged"] and r["loss_scale_unchanged"]
    assert r["replicas_identical_after_skip"]
    scale, _ = r["deriv_scales_before"]["2"]
    assert r["deriv_scales_after"]["2"] == [scale * 0.5, 0]  # backoff 0.5, tracker reset
    assert r["deriv_scale_replicas"]["2"] == [scale * 0.5] * 8
    # key "1" was not flagged: it counts a clean step by its own rule
    assert r["deriv_scales_after"]["1"] == r["deriv_scales_clean_update"]["1"]
    assert not r["next_step_skipped"] and r["params_changed_after_next"] and r["replicas_identical_after_next"]


@pytest.mark.slow  # end-to-end runs on 8 (2 x 2) fake devices in subprocesses
def test_compiled_step_reduces_flags_across_devices(worker):
    h = worker["hlo"]
    assert h["counts"]["all-reduce"] >= 1
    assert any("pred" in t for t in h["all_reduce_types"]), h["all_reduce_types"]  # the overflow flags
    assert any("f32" in t for t in h["all_reduce_types"]), h["all_reduce_types"]  # loss / gradients


@pytest.mark.slow  # end-to-end runs on 8 (2 x 2) fake devices in subprocesses
def test_indivisible_batch_errors_name_the_sizes(worker):
    e = worker["errors"]
    assert "63" in e["shard_batch"] and "8 device" in e["shard_batch"]
    assert "60" in e["data_parallel_step"] and "8 device" in e["data_parallel_step"]
    assert "`devices`=9" in e["make_mesh"]


@pytest.mark.slow  # end-to-end runs on 8 (2 x 2) fake devices in subprocesses
def test_multihost_two_processes_share_one_skip_decision():
    """jax.distributed.initialize with 2 local processes x 2 fake CPU devices (gloo)."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--multihost", str(i), "--port", str(port)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:  # a process left waiting for its peer must not outlive the test
            if p.poll() is None:
                p.kill()
    results = []
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, f"multihost worker failed (rc {p.returncode}):\n{err[-4000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["process_count"] == 2 and r["device_count"] == 4 and r["global_batch_shape"] == [16]
        # step 0: 2 + mean(0..15) on every device of both processes
        assert r["step0"] == {"skipped": False, "state": [9.5, 9.5]}
        # step 1: NaN only in process 1's half -> both processes skip
        assert r["step1"] == {"skipped": True, "state": [9.5, 9.5]}


SHARDED_FLAGS = """
import jax, jax.numpy as jnp, jaxamp
u = lambda x: jnp.exp(x.astype(jnp.float16)).astype(jnp.float32)
run = jax.jit(jaxamp.scaled(lambda x: jnp.sum(jax.vmap(jaxamp.grad(jaxamp.grad(u)))(x))))
scales = {"1": 2.0**6, "2": 2.0**6}
for big in (0.0, 8.0):
    x = jnp.zeros(8).at[5].set(big)
    sharded = jaxamp.parallel.shard_batch({"x": x}, jaxamp.parallel.make_mesh(2))["x"]
    flags = [sorted(k for k, v in run(scales, a)[1].items() if bool(v)) for a in (x, sharded)]
    print(flags)
"""


def test_flags_of_points_sharded_over_two_devices_are_the_unsharded_flags():
    """The flag reduction of jaxamp.scaled partitioned over 2 fake devices (a cross-device OR):
    nothing flagged on clean points, and the same keys as on one device when one shard
    overflows."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", SHARDED_FLAGS], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    clean, overflow = [json.loads(line.replace("'", '"')) for line in p.stdout.strip().splitlines()[-2:]]
    assert clean == [[], []] and overflow[0] == overflow[1] != [], (clean, overflow)


# ---- argument checks in this process (any device count) ----

def test_make_mesh_arguments():
    n = len(jax.devices())
    assert parallel.make_mesh().shape == {"batch": n}
    assert parallel.make_mesh(1).shape == {"batch": 1}
    assert parallel.make_mesh(jax.devices()[:1], axis_name="data").axis_names == ("data",)
    with pytest.raises(ValueError, match=rf"`devices`={n + 1} must be between 1 and the {n}"):
        parallel.make_mesh(n + 1)
    with pytest.raises(ValueError, match="`devices`=0"):
        parallel.make_mesh(0)
    with pytest.raises(TypeError, match="`devices`=True"):
        parallel.make_mesh(True)
    with pytest.raises(ValueError, match="more than once"):
        parallel.make_mesh([jax.devices()[0]] * 2)
    with pytest.raises(ValueError, match="`axis_name`"):
        parallel.make_mesh(1, axis_name="")


def test_mesh_and_batch_checks():
    mesh = parallel.make_mesh(1)
    two_axes = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    with pytest.raises(ValueError, match="one-axis mesh"):
        parallel.shard_batch({"x": np.zeros(4)}, two_axes)
    with pytest.raises(TypeError, match="`mesh`"):
        parallel.replicate({"w": np.zeros(2)}, "cpu")
    with pytest.raises(ValueError, match=r"\['t'\] is a scalar"):
        parallel.shard_batch({"t": np.float32(1.0)}, mesh)
    with pytest.raises(ValueError, match="batch_spec"):
        parallel.data_parallel_step(lambda s, b: (s, b), mesh, batch_spec=P("model"))
    with pytest.raises(ValueError, match="in_shardings"):
        parallel.data_parallel_step(lambda s, b: (s, b), mesh, in_shardings=None)
    with pytest.raises(TypeError, match="`step`"):
        parallel.data_parallel_step(None, mesh)


def test_one_device_path_and_mixed_batch_spec():
    mesh = parallel.make_mesh(1)

    def step(state, batch):
        new = state + jnp.mean(batch["interior"]) + jnp.sum(batch["boundary"])
        return new, {"m": jnp.mean(batch["interior"])}

    run = parallel.data_parallel_step(step, mesh, batch_spec={"interior": P("batch"), "boundary": P()})
    state = parallel.replicate(jnp.float32(1.0), mesh)
    batch = {"interior": parallel.shard_batch(np.arange(4, dtype=np.float32), mesh), "boundary": np.ones(3, np.float32)}
    new, metrics = run(state, batch)
    assert float(new) == 1.0 + 1.5 + 3.0 and float(metrics["m"]) == 1.5
    assert parallel.replicas_identical(new)
