"""The limits of a port from fp32 to fp16 + DerivScaler, for every ported example: at most 12
added or changed lines, each at most 100 characters and without a lambda, and the train step
changed by at most 3 lines (examples/jax_user: own loop and optax; examples/flax_user:
flax.training.train_state.TrainState, 4: ``apply_gradients`` passes the optimizer no extra
argument, so the port writes out its update given the step's ``flags``, then its ``replace``)."""

from pathlib import Path

import pytest

from tests.helpers.port_diff import added_lines, function_changes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MAX_CHANGED, MAX_CHARS, MAX_STEP_CHANGES = 12, 100, {"flax_user": 4}


@pytest.mark.parametrize("example", ["jax_user", "flax_user", "equinox_user", "nnx_user"])
def test_port_changes_at_most_12_short_readable_lines(example):
    added = added_lines(EXAMPLES / example / "fp32.py", EXAMPLES / example / "fp16.py")
    assert added and len(added) <= MAX_CHANGED, "\n".join(added)
    for line in added:
        assert len(line) <= MAX_CHARS and "lambda" not in line, line


@pytest.mark.parametrize("example", ["jax_user", "flax_user", "equinox_user", "nnx_user"])
def test_the_train_step_changes_by_at_most_three_lines(example):
    changed = function_changes(EXAMPLES / example / "fp32.py", EXAMPLES / example / "fp16.py", "train_step")
    assert 1 <= changed <= MAX_STEP_CHANGES.get(example, 3), changed
