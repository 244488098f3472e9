"""torch is an extra: importing jaxamp must not import torch, and torch_ref must not import jax."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow  # a fresh interpreter importing jax or torch (fast-suite budget); CI runs it
def test_import_jaxamp_does_not_import_torch():
    r = _run("import sys, jaxamp, jaxamp.models; assert 'torch' not in sys.modules, 'torch imported'")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow  # a fresh interpreter importing jax or torch (fast-suite budget); CI runs it
def test_import_torch_ref_does_not_import_jax():
    r = _run(
        "import sys, torch_ref, torch_ref.models\n"
        "bad = [m for m in ('jax', 'jaxamp', 'flax') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    assert r.returncode == 0, r.stderr
