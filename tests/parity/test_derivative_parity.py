"""Same weights, same points: jaxamp's and torch_ref's scaled derivatives and overflow flags.

fp16 agreement bound (stated, then checked). Both frameworks round the same ops to float16:
XLA (run with ``xla_allow_excess_precision=False``) and torch on CPU both accumulate f16
matmuls in f32 and round each op's result once. They differ only where an f32-level
difference (summation order, transcendental implementations) flips a rounding; each flip
is at most one f16 rounding, relative size ``u = 2^-11``. An order-k derivative runs the
network forward once and backward k times; each pass crosses ``L+1`` layers with three
f16 roundings each (matmul, bias add, activation), so ``D_k = 3 (k+1) (L+1)`` roundings
lie on a path, and for a well-conditioned small net the norm-relative difference is at
most ``D_k * u``. (For L=3: order 1: 24u = 1.2e-2, order 2: 36u = 1.8e-2.)
Measured (3x32 SiLU net, 64 points, orders 0-3): max norm-relative difference 2.2e-4 with
fp32 activations, 2.7e-3 with fp16 activations (torch's and XLA's f16 sigmoid differ by a
few ulp), i.e. 0.02-0.2 of the bound.
"""

import numpy as np
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES
from tests.helpers.parity import U16, build_pair, engines, evaluate, rel_err

RNG = np.random.default_rng(0)
PTS2 = RNG.uniform(-1, 1, (64, 2)).astype(np.float32)
PTS1 = RNG.uniform(-1, 1, (64, 1)).astype(np.float32)


def test_fp32_derivatives_orders_1_to_3_agree_to_1e_5():
    amp = jaxamp.AmpConfig(enabled=False)
    jm, params, tm = build_pair(amp, 2, 2)
    je, te = engines(jm, tm, amp, ("x", "y"), ("u", "v"), ("u__x__x__x", "u__x__y", "v__y"))
    dj, fj, dt, ft = evaluate(je, te, params, PTS2, {})
    assert set(dj) == set(dt) == {"u", "v", "u__x", "v__y", "u__x__x", "u__x__y", "u__x__x__x"}
    assert fj == ft == {}
    for name in dj:
        assert rel_err(dj[name], dt[name]) < 1e-5, name
        assert np.max(np.abs(dj[name] - dt[name])) <= 1e-5 * np.max(np.abs(dj[name])), name


@pytest.mark.parametrize("autocast_firstlayer, autocast_activation", [
    (False, False),
    # all-float16 and the mixed placements compile more engine pairs: in the slow run
    pytest.param(True, True, marks=pytest.mark.slow),
    pytest.param(False, True, marks=pytest.mark.slow),
    pytest.param(True, False, marks=pytest.mark.slow),
])
def test_fp16_derivatives_agree_within_the_rounding_bound(autocast_firstlayer, autocast_activation):
    amp = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=autocast_firstlayer,
                           autocast_activation=autocast_activation)
    jm, params, tm = build_pair(amp, 1, 1)
    je, te = engines(jm, tm, amp, ("x",), ("u",), ("u__x__x",))
    assert je.scaler_keys == te.scaler_keys == ("1", "2")
    scales = {"1": 0.5, "2": 0.25}  # non-trivial scales: unscaling must match too
    dj, fj, dt, ft = evaluate(je, te, params, PTS1, scales)
    assert fj == ft == {"1": False, "2": False, NONFINITE_VALUES: False}
    n_layers = 3 + 1
    for name in ("u", "u__x", "u__x__x"):
        order = name.count("__")
        bound = 3 * (order + 1) * n_layers * U16
        assert rel_err(dj[name], dt[name]) < bound, (name, rel_err(dj[name], dt[name]), bound)
    if not autocast_activation:  # f32 activations: the forward pass is bit-identical (measured)
        np.testing.assert_array_equal(dj["u"], dt["u"])


def _first_layer_boost(params, tm, factor):
    """Scale the first layer's weight_g by ``factor`` in both frameworks' copies."""
    import torch

    p = {"params": {k: dict(v) for k, v in params["params"].items()}}
    p["params"]["layers_0"]["weight_g"] = params["params"]["layers_0"]["weight_g"] * factor
    with torch.no_grad():
        tm.layers[0].linear.weight_g.mul_(factor)
    return p


def test_crafted_overflow_same_flags_and_same_backoffs():
    """First-layer weight_g x1600 with autocast_firstlayer=True: u__x__x overflows fp16, u__x does not.

    Overflow here is real fp16 overflow (no injected inf); XLA runs without excess precision.
    Both frameworks raise the same flags, and after the same number of backoffs of scaler 2
    both are finite.
    """
    amp = jaxamp.AmpConfig(dtype="float16", autocast_firstlayer=True)
    jm, params, tm = build_pair(amp, 1, 1, seed=0)
    params = _first_layer_boost(params, tm, 1600.0)
    pts = np.linspace(-1, 1, 65, dtype=np.float32)[:, None]  # x = 0: every unit at silu''(0)
    je, te = engines(jm, tm, amp, ("x",), ("u",), ("u__x__x",))
    rules = jaxamp.init(None, amp, keys=je.scaler_keys)().derivative.rules
    scales, history = {"1": 1.0, "2": 1.0}, []
    for _ in range(12):
        dj, fj, dt, ft = evaluate(je, te, params, pts, scales)
        assert fj == ft, (scales, fj, ft)
        history.append(fj)
        if not any(fj.values()):
            break
        for k in scales:  # back off exactly as the scaler rule does
            scales[k] = float(rules[k].update(rules[k].init()._replace(scale=np.float32(scales[k])), fj[k]).scale)
    assert history[0] == {"1": False, "2": True, NONFINITE_VALUES: False}, history[0]
    assert not any(history[-1].values()) and len(history) > 2  # needed more than one backoff
    assert scales["1"] == 1.0 and scales["2"] == 0.5 ** (len(history) - 1)
    for name in ("u__x", "u__x__x"):
        assert np.isfinite(dj[name]).all() and np.isfinite(dt[name]).all()
        assert rel_err(dj[name], dt[name]) < 3 * (name.count("__") + 1) * 4 * U16, (name, rel_err(dj[name], dt[name]))
    print(f"backoffs of scaler 2: {len(history) - 1}; max |u__x__x| = {np.abs(dj['u__x__x']).max():.4g}")
