"""benchmarks.roofline reads FP8 dots and the amax reductions of per-tensor scales from a lowered
program; benchmarks.ldc builds the per-tensor and FP8 modes (no train-step compile here)."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from benchmarks import ldc, roofline
from jaxamp.models import FullyConnected


def _lowered(amp):
    model = FullyConnected.from_amp(amp, out_features=3, layer_size=8, nr_layers=2)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))
    x = jnp.ones((4, 2))
    f = lambda p: jnp.sum(jax.jvp(lambda x: model.apply(p, x), (x,), (x,))[1] ** 2)  # noqa: E731
    return jax.jit(jax.grad(f)).lower(params).as_text()


def test_fp8_dots_are_counted_at_one_byte_and_priced_at_the_fp8_peak():
    text = _lowered(jaxamp.AmpConfig(dtype="float8", float8_formats={"tangent": "float8_e4m3fn"}))
    assert "f8E4M3FN" in text
    mm = roofline.matmul_flops(text)
    assert "f8E4M3FN" in mm and mm["f8E4M3FN"]["flops"] > 0
    # (4x8 f8 @ 8x8 f8 -> 4x8 f32): 32 + 64 bytes of operands, 128 of result
    one = ("%1 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : "
           "(tensor<4x8xf8E5M2>, tensor<8x8xf8E5M2>) -> tensor<4x8xf32>")
    assert roofline.matmul_flops(one) == {"f8E5M2": {"flops": 2.0 * 32 * 8, "bytes": 32 + 128 + 64}}
    for dev in roofline.DEVICES.values():
        assert dev["matmul"]["f8E4M3FN"] == dev["matmul"]["f8E5M2"] == 1979e12  # dense, 2x f16


def test_amax_bytes_only_with_per_tensor_scaling():
    assert roofline.amax_bytes(_lowered(jaxamp.AmpConfig(dtype="float16"))) == 0
    scaled = roofline.amax_bytes(_lowered(jaxamp.AmpConfig(dtype="float16", tensor_scaling=True)))
    assert scaled > 0
    assert roofline.amax_bytes(_lowered(jaxamp.AmpConfig(dtype="float8"))) == scaled  # the same operands


@pytest.mark.parametrize("mode, formats", [
    ("fp16_tensor", ("float16",) * 3),
    ("fp8_default", ("float16", "float16", "float8_e4m3fn")),
    ("fp8_all", ("float16", "float8_e4m3fn", "float8_e4m3fn")),
])
def test_tensor_modes(mode, formats):
    net, engine, step, precision = ldc.mode_settings(mode)
    assert net.tensor_scaling and net.matmul_formats == formats and engine == net == step
    assert precision == "default" and mode in ldc.ALL_MODES and mode not in ldc.MODES
