"""The per-tensor scale rule: jaxamp._src.placement.tensor_scale == torch_ref.tensor_scale, scale for scale and
product for product (float16, E4M3, E5M2), over operands whose magnitudes span 2^-40 .. 2^30."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxamp._src.placement.tensor_scale import scale_for, scaled_dot
from torch_ref import tensor_scale as ref

FORMATS = [(jnp.float16, torch.float16), (jnp.float8_e4m3fn, torch.float8_e4m3fn),
           (jnp.float8_e5m2, torch.float8_e5m2)]


@pytest.mark.parametrize("jdtype,tdtype", FORMATS)
def test_scale_trajectories_and_products_agree(jdtype, tdtype):
    rng = np.random.default_rng(0)
    scales_j, scales_t = [], []
    for k in range(-40, 31, 5):
        a = (rng.standard_normal((6, 8)) * 2.0**k).astype(np.float32)
        b = rng.standard_normal((8, 3)).astype(np.float32)
        scales_j.append(float(scale_for(jnp.asarray(a), jdtype)))
        scales_t.append(float(ref.scale_for(torch.from_numpy(a), tdtype)))
        ours = np.asarray(scaled_dot(jnp.asarray(a), jnp.asarray(b), (((1,), (0,)), ((), ())), (jdtype,) * 3))
        theirs = ref.scaled_matmul(torch.from_numpy(a), torch.from_numpy(b), tdtype).numpy()
        # float32 sums of the same exact products in another order: each differs by at most
        # n rounding errors of the partial sums, bounded through sum |a_i b_i| (2x for the rounded operands)
        bound = 2 * a.shape[1] * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b))
        assert np.all(np.abs(ours - theirs) <= bound), np.max(np.abs(ours - theirs) / bound)
    assert scales_j == scales_t
    assert len(set(scales_j)) > 10  # the scale follows the magnitude


def test_zero_and_nonfinite_operands_keep_scale_one():
    for v in (0.0, float("inf"), float("nan")):
        x = np.full((3,), v, np.float32)
        assert (float(scale_for(jnp.asarray(x), jnp.float16))
                == float(ref.scale_for(torch.from_numpy(x), torch.float16)) == 1.0)


@pytest.mark.parametrize("jdtype,tdtype", FORMATS)
def test_products_of_two_small_operands_agree_where_the_scales_together_leave_float32(jdtype, tdtype):
    # both scales near 2**64: their product passes float32's largest power of two, the result does not
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((4, 5)) * 2.0**-50).astype(np.float32)
    b = (rng.standard_normal((5, 2)) * 2.0**-50).astype(np.float32)
    ours = np.asarray(scaled_dot(jnp.asarray(a), jnp.asarray(b), (((1,), (0,)), ((), ())), (jdtype,) * 3))
    theirs = ref.scaled_matmul(torch.from_numpy(a), torch.from_numpy(b), tdtype).numpy()
    bound = 2 * a.shape[1] * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b))
    assert np.all(ours != 0) and np.all(np.abs(ours - theirs) <= bound)


@pytest.mark.parametrize("jdtype,tdtype", FORMATS)
def test_outer_products_round_each_entry_alike(jdtype, tdtype):
    # a contraction of length 1: every entry its own scale, over magnitudes 2^-100 .. 2^100 in one operand
    rng = np.random.default_rng(2)
    a = (rng.standard_normal((41, 1)) * 2.0 ** np.arange(-100, 101, 5)[:, None]).astype(np.float32)
    b = rng.standard_normal((1, 3)).astype(np.float32)
    ours = np.asarray(scaled_dot(jnp.asarray(a), jnp.asarray(b), (((1,), (0,)), ((), ())), (jdtype,) * 3))
    theirs = ref.scaled_matmul(torch.from_numpy(a), torch.from_numpy(b), tdtype).numpy()
    assert np.array_equal(ours, theirs)  # one exact product per entry: bit for bit
    assert np.all(ours != 0) and np.all(np.isfinite(ours))
