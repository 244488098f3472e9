"""torch.autocast versus torch_ref's explicit casts, on CPU (bfloat16 and float16 both work there).

What CPU autocast does to torch_ref's ``FullyConnected`` (built in float32, recorded op by op
with a ``TorchDispatchMode``; asserted in ``test_which_ops_autocast_runs_in_reduced_precision``):

- only the matmuls (``aten.mm``) run in the reduced dtype; autocast casts both operands
  (the input ``x`` of the *first* layer too, so there is no fp32 first layer);
- the weight norm ``g * v / ||v||`` (``linalg_vector_norm``, ``div``, ``mul``) stays float32;
- the bias add ``mm(x, W) + b`` promotes the reduced product with the float32 bias to
  float32, so the sum is *not* rounded to the reduced dtype, and the activation (sigmoid,
  mul) then runs in float32 on that unrounded sum; the network's output is float32.

torch_ref's explicit mode with ``autocast_firstlayer=True, autocast_activation=False`` casts
the same matmul operands and evaluates activations in float32, but adds the bias in the
reduced dtype (as jaxamp's ``jnp.dot(x, k) + b`` does). So (measured, asserted below):

- with zero biases (a freshly initialised net) the two agree bit for bit, forward and first
  input derivative: adding 0 does not round, and every other op sees the same values;
- with non-zero biases they differ by the extra rounding of each bias add, one rounding of
  relative size ``u`` (2^-8 bf16, 2^-11 fp16) per layer on the forward path and the same on
  the backward path: the norm-relative difference stays below ``2 (L+1) u``. Measured (3x16
  SiLU net, biases U(-0.5, 0.5), 33 points): bf16 9.6e-3 value / 4.8e-3 slope (bound 3.1e-2);
  fp16 1.2e-3 / 6.0e-4 (bound 3.9e-3).

Why the parity suite uses explicit casts rather than autocast: XLA has no autocast, so jaxamp
places every cast itself; autocast's placement (fp32 bias add, reduced first layer, no way to
run activations in the reduced dtype) cannot be asked of jaxamp's network, while torch_ref's
explicit casts reproduce jaxamp's placement op for op (see test_derivative_parity.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_ref.models import FullyConnected

DTYPES = {"bfloat16": (torch.bfloat16, 2.0**-8), "float16": (torch.float16, 2.0**-11)}
N_LAYERS = 3  # hidden layers; L + 1 = 4 matmuls on a path


class _OpLog(TorchDispatchMode):
    """Records ``(aten op, input dtypes, output dtype)`` of every op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func.overloadpacket.__name__), ins, out.dtype if isinstance(out, torch.Tensor) else None))
        return out


def _nets(dtype_name: str, zero_bias: bool):
    """(plain float32 net for autocast, explicit-cast net) with identical weights."""
    torch.manual_seed(1)
    plain = FullyConnected.from_amp({"enabled": False}, 1, 1, layer_size=16, nr_layers=N_LAYERS)
    explicit = FullyConnected.from_amp({"dtype": dtype_name, "autocast_firstlayer": True}, 1, 1,
                                       layer_size=16, nr_layers=N_LAYERS)
    assert explicit.dtype == DTYPES[dtype_name][0] and explicit.fp32_activations and not explicit.fp32_first_layer
    if not zero_bias:
        with torch.no_grad():
            for name, p in plain.named_parameters():
                if name.endswith("bias"):
                    p.uniform_(-0.5, 0.5)
    explicit.load_state_dict(plain.state_dict())
    return plain, explicit


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """``||a - b|| / ||a||`` (this file needs torch only, so it does not import tests.helpers.parity)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _value_and_slope(fn, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (dy,) = torch.autograd.grad(y.sum(), x)
    return y.detach().numpy().ravel(), dy.numpy().ravel()


X = torch.linspace(-1, 1, 33)[:, None]


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_which_ops_autocast_runs_in_reduced_precision(dtype_name):
    dtype, _ = DTYPES[dtype_name]
    plain, _ = _nets(dtype_name, zero_bias=False)
    with _OpLog() as log, torch.autocast("cpu", dtype=dtype):
        y = plain(X)
    assert y.dtype == torch.float32
    reduced = {op for op, _, out in log.ops if out == dtype}
    assert reduced == {"mm", "_to_copy"}, reduced  # only matmuls (and the casts feeding them)
    mms = [ins for op, ins, _ in log.ops if op == "mm"]
    assert len(mms) == N_LAYERS + 1 and all(ins == (dtype, dtype) for ins in mms)  # first layer too
    for op in ("linalg_vector_norm", "div", "sigmoid"):  # weight norm and activation: float32
        assert all(out == torch.float32 for o, _, out in log.ops if o == op), op
    adds = [(ins, out) for op, ins, out in log.ops if op == "add"]
    assert adds and all(ins == (dtype, torch.float32) and out == torch.float32 for ins, out in adds)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_autocast_equals_explicit_casts_with_zero_biases(dtype_name):
    dtype, _ = DTYPES[dtype_name]
    plain, explicit = _nets(dtype_name, zero_bias=True)
    with torch.autocast("cpu", dtype=dtype):
        ya, da = _value_and_slope(plain, X)
    ye, de = _value_and_slope(explicit, X)
    np.testing.assert_array_equal(ya, ye)
    np.testing.assert_array_equal(da, de)
    y32, _ = _value_and_slope(plain, X)
    assert not np.array_equal(ya, y32)  # and it really ran in reduced precision


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_autocast_differs_from_explicit_casts_by_the_bias_roundings(dtype_name):
    dtype, u = DTYPES[dtype_name]
    plain, explicit = _nets(dtype_name, zero_bias=False)
    with torch.autocast("cpu", dtype=dtype):
        ya, da = _value_and_slope(plain, X)
    ye, de = _value_and_slope(explicit, X)
    bound = 2 * (N_LAYERS + 1) * u
    assert not np.array_equal(ya, ye)  # the extra rounding of each bias add shows
    assert rel_err(ye, ya) < bound, (rel_err(ye, ya), bound)
    assert rel_err(de, da) < bound, (rel_err(de, da), bound)
    print(f"{dtype_name}: rel diff value {rel_err(ye, ya):.2e}, slope {rel_err(de, da):.2e}, bound {bound:.2e}")
