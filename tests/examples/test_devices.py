"""The examples' `training.devices` option: the same run on 1 and 2 (fake CPU) devices.

The two runs are separate processes (the fake device count is fixed when JAX starts) and run
at the same time, one per core.
"""

import json
import os
import subprocess
import sys

import pytest

from examples.burgers import Burgers
from examples.common.config import ConfigError
from examples.common.train import Setup
from tests.helpers.examples import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["model.layer_size=8", "model.nr_layers=2", "eval.grid=9", "training.chunk_steps=5",
        "training.checkpoint_every=10", "batch.initial=8", "batch.boundary=8", "batch.interior=16",
        "mode=fp32", "training.max_steps=10"]


def start(tmp_path, devices):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = tmp_path / f"d{devices}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.burgers", "--workdir", str(out), "--no-progress", *ARGS,
         f"training.devices={devices}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return proc, out


def losses(proc, out):
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two fresh processes of the example CLI; jaxamp.parallel's 1 vs 8 devices is in the fast suite
def test_two_devices_follow_the_one_device_run(tmp_path):
    runs = [start(tmp_path, 1), start(tmp_path, 2)]
    try:
        one, two = [losses(*r) for r in runs]
    finally:
        for proc, _ in runs:  # a run left behind by a failure must not outlive the test
            if proc.poll() is None:
                proc.kill()
    assert len(one) == len(two) == 10
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)


def test_bad_device_counts_are_rejected_before_training():
    with pytest.raises(ConfigError, match="training.devices=64 is not allowed"):
        Setup(Burgers, tiny(Burgers, "fp32", 2) | {"training": {**tiny(Burgers, "fp32", 2)["training"], "devices": 64}})
