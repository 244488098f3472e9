"""Bad values are not overflows, in both frameworks (docs/algorithm.md, "Differences from Modulus Sym").

- The engines: a NaN or inf input point sets ``nonfinite_values`` and no scaler key; a true
  overflow (the network plus sqrt(x), whose derivative is inf at x = 0 where the value is
  finite) flags its key only, and not the order above it (its level below is non-finite
  there). Same flags from jaxamp (both methods) and torch_ref.
- The train step: on the 1D Poisson pair, NaN points and an infinite source term (a non-finite
  loss no derivative explains) at chosen steps are skipped with SKIP_NONFINITE_VALUES and change
  no scaler (scales and trackers) in either framework.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxamp
import torch_ref
from jaxamp import NONFINITE_VALUES
from tests.helpers.parity import build_pair, evaluate
from tests.helpers.poisson_pair import fresh_pair, run_jax, run_torch, trajectory

AMP = jaxamp.AmpConfig(dtype="float16")
X = np.linspace(0.0, 1.0, 9, dtype=np.float32)[1:, None]  # no zero: every derivative finite


def points(first):
    return np.concatenate([[[first]], X]).astype(np.float32)


@pytest.fixture(scope="module")
def pair():
    jm, params, tm = build_pair(AMP, 1, 1, layer_size=16, nr_layers=2)
    derivs = ("u__x", "u__x__x")
    engines = {}
    for method in ("reverse", "forward"):
        engines[method] = jaxamp.Derivatives(lambda p, x: jm.apply(p, x) + jnp.sqrt(x), inputs=("x",), outputs=("u",),
                                             derivatives=derivs, amp=AMP, method=method)
    te = torch_ref.Derivatives(lambda x: tm(x) + torch.sqrt(x), inputs=("x",), outputs=("u",), derivatives=derivs,
                               amp=AMP.to_dict())
    return engines, te, params


@pytest.mark.parametrize("method", ["reverse", "forward"])
@pytest.mark.parametrize(
    "first, expected",
    [
        (0.5, {"1": False, "2": False, NONFINITE_VALUES: False}),
        (np.nan, {"1": False, "2": False, NONFINITE_VALUES: True}),
        (np.inf, {"1": False, "2": False, NONFINITE_VALUES: True}),
        (0.0, {"1": True, "2": False, NONFINITE_VALUES: False}),  # d sqrt(x)/dx = inf at 0: an overflow of key 1
    ],
    ids=["clean", "nan_input", "inf_input", "overflow"],
)
def test_engines_flag_bad_values_and_overflows_alike(pair, method, first, expected):
    engines, te, params = pair
    _, fj, _, ft = evaluate(engines[method], te, params, points(first), {"1": 1.0, "2": 1.0})
    assert fj == expected and ft == expected


@pytest.mark.slow  # an end-to-end run (fast-suite budget); CI runs it
def test_bad_value_steps_change_no_scaler_in_either_framework():
    nan, overflow = frozenset({3, 4, 9}), frozenset({4, 7})  # step 4: both, bad values take precedence
    inf_loss = frozenset({10})
    js, jstep, ts, tstep = fresh_pair("fp16")
    _, jm = run_jax(js, jstep, range(12), overflow, nan, inf_loss)
    tm = run_torch(ts, tstep, range(12), overflow, nan, inf_loss)
    assert trajectory(jm) == trajectory(tm)
    for ms in (jm, tm):
        reasons = [int(m["skip_reason"]) for m in ms]
        assert reasons[3] == reasons[4] == reasons[9] == reasons[10] == jaxamp.SkipReason.NONFINITE_VALUES
        assert reasons[7] == jaxamp.SkipReason.DERIVATIVE_OVERFLOW and float(ms[7]["scale_log2/2"]) == -1
        for i in range(1, 12):
            m, prev = ms[i], ms[i - 1]
            assert bool(m["found_nonfinite_values"]) == (i in nan | inf_loss)
            if i in nan | inf_loss:
                assert bool(m["skipped"])
                assert {k: int(v) for k, v in m["trackers"].items()} == {k: int(v) for k, v in prev["trackers"].items()}
                assert int(m["loss_tracker"]) == int(prev["loss_tracker"])
                scales = [k for k in m if k.startswith("scale_log2/")]
                assert [float(m[k]) for k in scales] == [float(prev[k]) for k in scales]
    assert torch_ref.SKIP_NONFINITE_VALUES == jaxamp.SkipReason.NONFINITE_VALUES
    assert torch_ref.NONFINITE_VALUES == NONFINITE_VALUES
