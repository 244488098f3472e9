"""``python -m benchmarks gpu_program``: its HLO reading and time model on a hand-written GPU HLO module
(always), and the deviceless H100 compile at a tiny size where the CUDA plugin is installed (skipped
otherwise: it lives in a venv of its own, never in CI)."""

import importlib.util
import json
import math

import pytest

from benchmarks import gpu_program as gp

# What XLA's GPU compiler prints, cut down: a loop fusion, a Triton GEMM fusion (f16 operands, f32
# ones converted inside), a cuBLAS call with its s8 workspace, a conditional (a skip: one branch
# zeroes and copies, the other passes through), a while loop of known trip count.
# (A line ending in a backslash goes on in the next: XLA prints each instruction on one line.)
HLO = """HloModule jit_step, entry_computation_layout={(f32[64,32]{1,0})->f32[64,16]{1,0}}

%fused_tanh (param_0: f32[64,32]) -> (f16[64,32], f32[64,32]) {
  %param_0 = f32[64,32]{1,0} parameter(0)
  %tanh.1 = f32[64,32]{1,0} tanh(%param_0), metadata={op_name="jit(step)/tanh"}
  %multiply.2 = f32[64,32]{1,0} multiply(%tanh.1, %tanh.1)
  %convert.3 = f16[64,32]{1,0} convert(%tanh.1)
  ROOT %tuple.4 = (f16[64,32]{1,0}, f32[64,32]{1,0}) tuple(%convert.3, %multiply.2)
}

%gemm_fusion_dot.7_computation (parameter_0: f16[64,32], parameter_1: f32[32,16]) -> f32[64,16] {
  %parameter_0 = f16[64,32]{1,0} parameter(0)
  %parameter_1 = f32[32,16]{1,0} parameter(1)
  %convert.5 = f16[32,16]{1,0} convert(%parameter_1)
  ROOT %dot.6 = f32[64,16]{1,0} dot(%parameter_0, %convert.5), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (param_0.1: f32[16]) -> f32[16] {
  %param_0.1 = f32[16]{0} parameter(0)
  ROOT %add.8 = f32[16]{0} add(%param_0.1, %param_0.1)
}

%skip (arg_tuple.1: (f32[16])) -> (f32[16]) {
  %arg_tuple.1 = (f32[16]{0}) parameter(0)
  %get-tuple-element.9 = f32[16]{0} get-tuple-element(%arg_tuple.1), index=0
  %loop_add_fusion.1 = f32[16]{0} fusion(%get-tuple-element.9), kind=kLoop, calls=%fused_add
  %copy.10 = f32[16]{0} copy(%loop_add_fusion.1)
  ROOT %tuple.11 = (f32[16]{0}) tuple(%copy.10)
}

%pass (arg_tuple.2: (f32[16])) -> (f32[16]) {
  %arg_tuple.2 = (f32[16]{0}) parameter(0)
  ROOT %get-tuple-element.12 = f32[16]{0} get-tuple-element(%arg_tuple.2), index=0
}

%body (p.1: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p.1 = (s32[], f32[16]{0}) parameter(0)
  %get-tuple-element.13 = f32[16]{0} get-tuple-element(%p.1), index=1
  %get-tuple-element.14 = s32[] get-tuple-element(%p.1), index=0
  %loop_add_fusion.2 = f32[16]{0} fusion(%get-tuple-element.13), kind=kLoop, calls=%fused_add
  ROOT %tuple.15 = (s32[], f32[16]{0}) tuple(%get-tuple-element.14, %loop_add_fusion.2)
}

%cond (p.2: (s32[], f32[16])) -> pred[] {
  %p.2 = (s32[], f32[16]{0}) parameter(0)
  ROOT %constant.16 = pred[] constant(true)
}

ENTRY %main.17 (x.1: f32[64,32], w.1: f32[32,16], v.1: f32[16], s.1: pred[]) -> f32[64,16] {
  %x.1 = f32[64,32]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = f32[32,16]{1,0} parameter(1)
  %v.1 = f32[16]{0} parameter(2)
  %s.1 = pred[] parameter(3)
  %loop_tanh_fusion = (f16[64,32]{1,0}, f32[64,32]{1,0}) fusion(%x.1), kind=kLoop, calls=%fused_tanh, \
metadata={op_name="jit(step)/tanh"}
  %get-tuple-element.18 = f16[64,32]{1,0} get-tuple-element(%loop_tanh_fusion), index=0
  %gemm_fusion_dot.7 = f32[64,16]{1,0} fusion(%get-tuple-element.18, %w.1), kind=kCustom, \
calls=%gemm_fusion_dot.7_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %get-tuple-element.19 = f32[64,32]{1,0} get-tuple-element(%loop_tanh_fusion), index=1
  %custom-call.20 = (f32[64,32]{1,0}, s8[4194304]{0}) custom-call(%get-tuple-element.19, %x.1), \
custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":\
{"lhs_contracting_dimensions":["0"],"rhs_contracting_dimensions":["0"]},\
"precision_config":{"operand_precision":["HIGHEST","HIGHEST"]}}}
  %tuple.21 = (f32[16]{0}) tuple(%v.1)
  %conditional.22 = (f32[16]{0}) conditional(%s.1, %tuple.21, %tuple.21), true_computation=%skip, \
false_computation=%pass, metadata={op_name="jit(step)/cond"}
  %tuple.23 = (s32[], f32[16]{0}) tuple(%s.1, %v.1)
  %while.24 = (s32[], f32[16]{0}) while(%tuple.23), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %copy.25 = f32[64,16]{1,0} copy(%gemm_fusion_dot.7)
}
"""


@pytest.fixture(scope="module")
def parsed():
    comps, entry = gp.parse_module(HLO)
    return comps, entry, gp.program(comps, entry)


def test_parse_module(parsed):
    comps, entry, _ = parsed
    assert entry == "main.17"
    assert set(comps) == {"fused_tanh", "gemm_fusion_dot.7_computation", "fused_add", "skip", "pass", "body", "cond",
                          "main.17"}
    fusion = next(i for i in comps[entry].instrs if i.name == "loop_tanh_fusion")
    assert (fusion.op, fusion.operands, fusion.attr("calls"), fusion.attr("kind")) == ("fusion", ["x.1"],
                                                                                        "fused_tanh", "kLoop")
    assert fusion.op_name == "jit(step)/tanh"
    assert gp.arrays(fusion.shape) == [("f16", (64, 32)), ("f32", (64, 32))]
    assert gp.shape_bytes(fusion.shape) == 64 * 32 * (2 + 4)
    assert gp.shape_bytes("(f32[8]{0}, s8[1024]{0})", skip_workspace=True) == 32
    assert gp.shape_bytes("f8e4m3fn[4,4]{1,0}") == 16 and gp.shape_bytes("pred[]") == 1


def test_kernels_and_bytes(parsed):
    _, _, prog = parsed
    names = [(k.name, k.times) for k in prog.kernels]
    # entry: tanh fusion, GEMM fusion, cuBLAS call, copy; the skip branch (fusion + copy, the larger);
    # the loop body's fusion three times (its condition launches nothing)
    assert names == [("loop_tanh_fusion", 1), ("gemm_fusion_dot.7", 1), ("custom-call.20", 1),
                     ("loop_add_fusion.1", 1), ("copy.10", 1), ("loop_add_fusion.2", 3), ("copy.25", 1)]
    assert prog.kernel_count == 9 and prog.kernel_count_min == 7
    assert prog.conditionals == [{"name": "conditional.22", "op_name": "jit(step)/cond", "branches": [2, 0]}]
    assert prog.loops == [{"name": "while.24", "trip_count": 3, "kernels_per_trip": 1}]
    kernels = {k.name: k for k in prog.kernels}
    tanh, gemm, cublas = kernels["loop_tanh_fusion"], kernels["gemm_fusion_dot.7"], kernels["custom-call.20"]
    assert (tanh.kind, gemm.kind, cublas.kind, kernels["copy.25"].kind) == ("kLoop", "gemm", "__cublas$gemm", "copy")
    assert (tanh.read, tanh.write) == (64 * 32 * 4, 64 * 32 * 6)
    assert (gemm.read, gemm.write) == (64 * 32 * 2 + 32 * 16 * 4, 64 * 16 * 4)
    assert cublas.write == 64 * 32 * 4  # without the s8 workspace
    assert tanh.where == "main.17" and kernels["copy.10"].where == "skip"


def test_flops_by_dtype(parsed):
    _, _, prog = parsed
    kernels = {k.name: k for k in prog.kernels}
    assert kernels["loop_tanh_fusion"].flops == {"vector": 2 * 64 * 32}  # tanh, multiply; convert: none
    assert kernels["gemm_fusion_dot.7"].flops == {"f16": 2 * 64 * 16 * 32}  # the dot's lhs dtype
    # contracting dim 0 of the f32[64,32] lhs at HIGHEST: 2 * 64*32 (result) * 64, at the f32 peak
    assert kernels["custom-call.20"].flops == {"f32": 2 * 64 * 32 * 64}
    assert kernels["copy.25"].flops == {}
    assert gp.summarize(prog)["flops"] == {"vector": 2 * 64 * 32 + 16 + 3 * 16, "f16": 2 * 64 * 16 * 32,
                                           "f32": 2 * 64 * 32 * 64}
    dot = gp.parse_instr('  %d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}')
    assert gp.dot_flops(dot, {"a": "f32[4,8]{1,0}"}) == ("tf32", 2 * 16 * 8)  # default precision: TF32


def test_time_model(parsed):
    _, _, prog = parsed
    device = {"hbm": 1e12, "peaks": {"f32": 1e9, "tf32": 1e12, "f16": 1e13, "vector": 1e12, "f8": 1e14}}
    kernels = {k.name: k for k in prog.kernels}
    cublas, copy = kernels["custom-call.20"], kernels["copy.25"]
    assert math.isclose(gp.kernel_time(cublas, device), 2 * 64 * 32 * 64 / 1e9)  # compute-bound at 1 GFLOP/s
    assert math.isclose(gp.kernel_time(copy, device), 2 * 64 * 16 * 4 / 1e12)  # memory-bound
    t = gp.model_time(prog, device, launch_s=1e-6)
    work = sum(gp.kernel_time(k, device) * k.times for k in prog.kernels)
    assert math.isclose(t["work_us"], 1e6 * work)
    assert math.isclose(t["launch_us"], 9 + 1)  # nine kernels and the conditional's predicate
    assert math.isclose(t["total_us"], t["work_us"] + t["launch_us"])
    summary = gp.summarize(prog)
    assert summary["kernels"] == 9 and summary["kernels_by_kind"]["copy"] == 2
    assert set(summary["model"]) >= {"H100 SXM launch", "H100 SXM command_buffer", "H200 SXM launch"}


def test_sizes():
    assert gp.parse_sizes("4x128:20000, 2x8:32") == [gp.Size(4, 128, 20000), gp.Size(2, 8, 32)]
    assert gp.Size(4, 512, 6000).boundary == 600
    assert gp.parse_sizes(gp.DEFAULT_CAVITY_SIZES, "cavity") == [gp.Size(6, 512, 4000, "cavity")]
    assert gp.Size(6, 512, 4000, "cavity").boundary == 1000  # Modulus' 1000 lid / 1000 wall points
    with pytest.raises(SystemExit):
        gp.parse_sizes("4x128")


def test_problems_refuses_an_unknown_one():
    with pytest.raises(SystemExit):
        gp.main(["--problems", "poisson,cavty"])


def _plugin_installed() -> bool:
    try:
        return importlib.util.find_spec(gp.PLUGIN_MODULE) is not None
    except ImportError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _plugin_installed(), reason="jax-cuda12-plugin not installed (a venv of its own)")
def test_deviceless_compile_tiny(tmp_path):
    out = tmp_path / "gpu_program.json"
    result = gp.main(["--sizes", "2x8:32", "--cavity-sizes", "2x8:16", "--modes", "fp32_engine,fp16_scaler",
                      "--out", str(out)])
    rows = {(r["problem"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(p, m) for p in gp.PROBLEMS for m in ("fp32_engine", "fp16_scaler")} and result["jax"]
    for row in rows.values():
        assert "error" not in row and row["kernels"] > 0 and row["memory"]["temp"] >= 0
        assert row["model"]["H100 SXM launch"]["total_us"] > row["model"]["H100 SXM command_buffer"]["total_us"]
    for problem in gp.PROBLEMS:
        assert rows[problem, "fp16_scaler"]["flops"].get("f16", 0) > 0
        assert rows[problem, "fp32_engine"]["flops"].get("f32", 0) > 0


def test_time_refuses_a_negative_count():
    with pytest.raises(SystemExit):
        gp.main(["--time", "-1"])


@pytest.mark.slow
def test_time_on_the_local_device_tiny(tmp_path):
    """``--time``: compiled for the local device (here the CPU; on a lent GPU, benchmarks/gpu.sh) and
    timed, the measured times beside the model's in each row."""
    out = tmp_path / "gpu_program.json"
    gp.main(["--problems", "poisson", "--sizes", "2x8:32", "--modes", "fp32_engine,fp16_scaler", "--time", "3",
             "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["target"]["file"] is None and result["target"]["device"]
    for row in result["rows"]:
        assert "error" not in row and row["kernels"] > 0, row.get("error")
        assert row["measured_us"]["reps"] == 3 and 0 < row["measured_us"]["min"] <= row["measured_us"]["median"]


@pytest.mark.slow  # two cavity step compiles
def test_cavity_user_grad_matches_the_engine():
    """The cavity's user step (nested ``jax.grad``) and its engine step have the same loss (float32, tiny).
    Last in this file: it starts JAX's backends, after which the deviceless compile above cannot."""
    import jax

    size = gp.Size(2, 8, 16, "cavity")
    with jax.default_matmul_precision("highest"):
        losses = [jax.jit(step)(*args)[-1] for step, args in
                  (gp.build_step(m, size) for m in ("fp32_engine", "fp32_jax_grad"))]
    assert math.isfinite(float(losses[0])) and abs(float(losses[0]) - float(losses[1])) <= 1e-5 * float(losses[0])
