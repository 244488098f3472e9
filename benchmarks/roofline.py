"""``python -m benchmarks roofline``: the GPU step-time ratio of the LDC step, predicted on paper.

For each precision mode of :mod:`benchmarks.ldc` the train step is compiled on the backend at
hand and measured with XLA's cost analysis (FLOPs, bytes accessed) and by its program:

- matmul FLOPs by operand dtype, from the lowered (pre-optimisation) StableHLO program, where
  every ``dot_general`` still has the dtype the mode asked for (XLA's CPU compiler later
  computes float16 dots in float32, so the optimised program does not tell);
- the rest of XLA's FLOPs (elementwise work, reductions; with per-tensor scaling also the
  amax reductions, scale and unscale multiplies of ``jaxamp/_src/placement/tensor_scale.py``);
- bytes accessed (optimised program) and the bytes the dots' operands and results occupy in
  their own dtypes (a floor: the traffic if everything else fused into them; FP8 operands
  ``f8E4M3FN`` / ``f8E5M2`` are 1 byte, the scaled dots' float32 results 4);
- the bytes the per-tensor scales' amax reductions read (one pass over each distinct operand
  before its cast: the reduction must finish before the scaled cast can start);
- the number of kernels (fusions, dots and other top-level instructions of the optimised program).

With a device's peaks (:data:`DEVICES`) each mode's step time is bounded below by the
roofline ``max(compute, memory)`` and estimated by the sum ``compute + memory + launches``,
where compute is matmul FLOPs at the dtype's matmul peak plus the rest at the float32 CUDA-core
peak, memory is bytes at the HBM bandwidth, and launches count a fixed cost per kernel. The
ratio fp32 / mode is the predicted speed-up. The assumptions are written in docs/benchmarks.md.

    python -m benchmarks roofline [--size 6x512:4000/1000/1000] [--modes ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any, Dict, List, Optional

import jax

from benchmarks import ldc, runner, timing
from benchmarks.runner import parse_size

# Vendor data-sheet peaks (dense, no sparsity): FLOP/s per matmul dtype, CUDA-core float32
# FLOP/s, HBM bytes/s. "highest" float32 matmuls run on CUDA cores (no TF32). FP8 (E4M3 and
# E5M2) Tensor Core: 3,958 TFLOP/s "with sparsity" on both data sheets, 1,979 dense
# (nvidia.com/en-us/data-center/h100, nvidia.com/en-us/data-center/h200; the Hopper
# architecture whitepaper's table: FP8 1978.9 dense, 3957.8 sparse, H100 SXM5).
_HOPPER = {"f32": 67e12, "tf32": 494e12, "bf16": 989e12, "f16": 989e12, "f8E4M3FN": 1979e12, "f8E5M2": 1979e12}
DEVICES = {
    "H200 SXM": {"matmul": _HOPPER, "vector": 67e12, "hbm": 4.8e12},
    "H100 SXM": {"matmul": _HOPPER, "vector": 67e12, "hbm": 3.35e12},
}
LAUNCH_S = 3e-6  # assumed cost of one kernel launch on the device (no CUDA graphs)
MODES = ("fp32_highest", "bf16", "fp16_plain", "fp16_noscale", "fp16_scaled_order")
FP16 = "fp16_scaled_order"  # the reference of the time ratios "vs_fp16"
_DOT = re.compile(r"stablehlo\.dot_general\s[^\n]*?contracting_dims\s*=\s*\[([0-9, ]*)\]\s*x\s*\[[0-9, ]*\]"
                  r"[^\n]*?:\s*\(tensor<([0-9x]+)x(\w+)>,\s*tensor<[0-9x]+x(\w+)>\)\s*->\s*tensor<([0-9x]+)x(\w+)>")
# amax of a per-tensor scale: ``%a = stablehlo.abs %x`` then a max-reduce of ``%a`` (to a scalar)
_ABS = re.compile(r"^\s*(%[\w#]+) = stablehlo\.abs (%[\w#]+) :", re.M)
_AMAX = re.compile(r"stablehlo\.reduce\((%[\w#]+) init: [^)]*\) applies stablehlo\.maximum across dimensions = "
                   r"\[[0-9, ]*\] : \(tensor<([0-9x]+)x(\w+)>, tensor<\w+>\) -> tensor<\w+>")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = \w+\[([0-9,]*)\]", re.M)
_OPT_DOT = re.compile(r"= \w+\[([0-9,]*)\]\S* dot\(%?([\w.\-]+), [^)]*\), lhs_contracting_dims=\{([0-9,]*)\}")
_KERNEL = re.compile(r"^\s+\S+ = \S+ (fusion|dot|custom-call|convolution|reduce|sort|scatter|gather|copy)\(", re.M)


def matmul_flops(stablehlo: str) -> Dict[str, Dict[str, float]]:
    """``{dtype: {"flops": ..., "bytes": ...}}`` of every ``dot_general`` of a StableHLO program
    by its lhs operand's dtype (``2 * result size * contracted size``; bytes of both operands
    and the result, each at its own dtype)."""
    out: Dict[str, Dict[str, float]] = {}
    for m in _DOT.finditer(stablehlo):
        contract, lhs, dtype, rhs_dt, res, res_dt = m.groups()
        lhs_shape = [int(v) for v in lhs.split("x")]
        res_shape = [int(v) for v in res.split("x")]
        k = 1
        for d in (int(v) for v in contract.replace(" ", "").split(",") if v):
            k *= lhs_shape[d]
        n_res = 1
        for v in res_shape:
            n_res *= v
        n_lhs = 1
        for v in lhs_shape:
            n_lhs *= v
        e = out.setdefault(dtype, {"flops": 0.0, "bytes": 0.0})
        e["flops"] += 2.0 * n_res * k
        e["bytes"] += _size(dtype) * n_lhs + _size(res_dt) * n_res + _size(rhs_dt) * k * (n_res // max(1, res_shape[0]))
    return out  # lhs, result, ~rhs


def _size(dtype: str) -> int:
    """Bytes per element of a StableHLO element type (``f8E4M3FN``, ``f16``, ``f32``, ...)."""
    return 1 if dtype.startswith("f8") else {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}.get(dtype, 4)


def amax_bytes(stablehlo: str) -> float:
    """Bytes the amax reductions of per-tensor scales read: every max-reduce of an ``abs`` in the
    lowered program, each distinct operand once per function (XLA merges duplicates)."""
    total = 0.0
    for func in stablehlo.split("func.func")[1:]:
        of = dict(_ABS.findall(func))
        seen = set()
        for m in _AMAX.finditer(func):
            src = of.get(m.group(1))
            if src is None or src in seen:
                continue
            seen.add(src)
            total += _size(m.group(3)) * _prod(m.group(2).replace("x", ","))
    return total


def _prod(dims: str) -> int:
    out = 1
    for v in dims.split(","):
        if v:
            out *= int(v)
    return out


def optimised_dot_flops(hlo: str) -> float:
    """FLOPs of every ``dot`` of an optimised HLO module (``2 * result size * contracted size``):
    what the compiled program runs, after XLA removed dead and duplicate work."""
    shapes = {m.group(1): m.group(2) for m in _DEF.finditer(hlo)}
    total = 0.0
    for m in _OPT_DOT.finditer(hlo):
        lhs = [int(v) for v in shapes.get(m.group(2), "").split(",") if v]
        k = 1
        for d in (int(v) for v in m.group(3).split(",") if v):
            k *= lhs[d] if d < len(lhs) else 1
        total += 2.0 * _prod(m.group(1)) * k
    return total


def analyse(mode: str, size: ldc.LDCSize, params: Any, points: Any) -> Dict[str, Any]:
    """Cost of one LDC train step of ``mode`` on the current backend (compiled once per run,
    shared with :func:`benchmarks.runner.bench_steps`)."""
    s, compiled, compile_s = runner.cached_step(mode, size, params, points)
    with s.precision():
        lowered = jax.jit(s.step).lower(s.state, s.batch)
    lowered_text = lowered.as_text()
    mm = matmul_flops(lowered_text)
    cost = timing.cost_of(compiled)
    text = compiled.as_text()
    # The optimised program's dot FLOPs, split by dtype in the lowered program's proportions
    # (the CPU compiler computes float16 dots in float32, so the optimised dtypes do not tell).
    mm_flops = optimised_dot_flops(text)
    lowered_total = sum(v["flops"] for v in mm.values()) or 1.0
    for v in mm.values():
        v["share"] = v["flops"] / lowered_total
        v["optimised_flops"] = v["share"] * mm_flops
    return {"matmul": mm, "matmul_flops": mm_flops, "lowered_matmul_flops": lowered_total, **cost,
            "compile_s": compile_s, "other_flops": max(0.0, (cost["flops"] or 0.0) - mm_flops),
            "amax_bytes": amax_bytes(lowered_text),
            "kernels": len(_KERNEL.findall(text)), "xla_memory": timing.memory_of(compiled)}


def device_bytes(modes: Dict[str, Dict[str, Any]], backend: str) -> Dict[str, float]:
    """Bytes each mode's step moves on the GPU: XLA's count where the program was compiled for
    a GPU; else the float32 step's count times the ratio of the mode's dot operand bytes to
    float32's (the same tensors at their own width: the CPU compiler's float16 programs carry
    float32 copies of float16 tensors that a GPU program does not), plus the amax reductions'
    reads of a per-tensor-scaled mode (the scaled cast itself replaces the plain cast)."""
    ref = modes.get("fp32_highest")
    out = {}
    for m, a in modes.items():
        if backend == "gpu" or ref is None:
            out[m] = a["bytes_accessed"] or 0.0
        else:
            width = sum(v["bytes"] for v in a["matmul"].values()) / sum(v["bytes"] for v in ref["matmul"].values())
            out[m] = (ref["bytes_accessed"] or 0.0) * width + a.get("amax_bytes", 0.0)
    return out


def predict(a: Dict[str, Any], mode: str, n_bytes: float, dev: Dict[str, Any]) -> Dict[str, float]:
    """Roofline bound ``max(compute, memory)`` and additive estimate ``compute + memory +
    launches`` (seconds) of one step on a device."""
    dt = {"fp32_highest": "f32"}.get(mode)
    t_mm = sum(v["optimised_flops"] / dev["matmul"][dt or k] for k, v in a["matmul"].items())
    t_vec = a["other_flops"] / dev["vector"]
    t_mem = n_bytes / dev["hbm"]
    t_launch = a["kernels"] * LAUNCH_S
    return {"bytes": n_bytes, "compute_s": t_mm + t_vec, "matmul_s": t_mm, "vector_s": t_vec, "memory_s": t_mem,
            "launch_s": t_launch, "roofline_s": max(t_mm + t_vec, t_mem),
            "additive_s": t_mm + t_vec + t_mem + t_launch}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="6x512:4000/1000/1000")
    ap.add_argument("--modes", nargs="+", choices=ldc.ALL_MODES, default=list(MODES))
    ap.add_argument("--time", action="store_true", help="also time the steps (interleaved) on this device")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=3, help="steps per timed sample")
    ap.add_argument("--out", help="write the analysis and predictions as JSON here")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.inner < 1:
        ap.error(f"--reps={a.reps} and --inner={a.inner} must be >= 1")
    size = parse_size(a.size)
    params, points = ldc.init_params(size), ldc.make_points(size)
    res: Dict[str, Any] = {"meta": {**timing.device_info(), "size": a.size, "launch_s": LAUNCH_S,
                                    "argv": sys.argv if argv is None else argv,
                                    "started": time.strftime("%Y-%m-%dT%H:%M:%S")}, "modes": {}}
    for mode in a.modes:
        res["modes"][mode] = analyse(mode, size, params, points)
        print(f"analysed {mode}", file=sys.stderr, flush=True)
    res["predictions"] = {}
    ref = "fp32_highest" if "fp32_highest" in res["modes"] else None
    n_bytes = device_bytes(res["modes"], res["meta"]["backend"])
    for dev_name, dev in DEVICES.items():
        p = {m: predict(r, m, n_bytes[m], dev) for m, r in res["modes"].items()}
        if ref:
            for m in p:
                p[m]["speedup_roofline_vs_fp32"] = p[ref]["roofline_s"] / p[m]["roofline_s"]
                p[m]["speedup_additive_vs_fp32"] = p[ref]["additive_s"] / p[m]["additive_s"]
        if FP16 in p:  # step time over fp16's (fp16 + DerivScaler per order): < 1 is faster
            for m in p:
                p[m]["time_roofline_vs_fp16"] = p[m]["roofline_s"] / p[FP16]["roofline_s"]
                p[m]["time_additive_vs_fp16"] = p[m]["additive_s"] / p[FP16]["additive_s"]
        res["predictions"][dev_name] = p
    print(f"LDC step {a.size} on {res['meta']['backend']} ({res['meta']['device_kind']}): XLA cost analysis")
    print(f"{'mode':18s} {'XLA GF':>7s} {'dot GF':>7s} {'dot dtypes':>22s} {'XLA GB':>7s} {'GPU GB':>7s} "
          f"{'dot GB':>7s} {'amax GB':>7s} {'kernels':>7s}")
    for m, r in res["modes"].items():
        dts = " ".join(f"{k}:{v['share']:.2f}" for k, v in sorted(r["matmul"].items()))
        print(f"{m:18s} {(r['flops'] or 0) / 1e9:7.2f} {r['matmul_flops'] / 1e9:7.2f} {dts:>22s} "
              f"{(r['bytes_accessed'] or 0) / 1e9:7.2f} {n_bytes[m] / 1e9:7.2f} "
              f"{sum(v['bytes'] for v in r['matmul'].values()) / 1e9:7.2f} {r['amax_bytes'] / 1e9:7.2f} "
              f"{r['kernels']:7d}")
    for dev_name, p in res["predictions"].items():
        print(f"\n{dev_name}, predicted ms: compute, memory, launches ({LAUNCH_S * 1e6:.0f} us each); "
              f"roofline max(compute, memory) | additive sum; speed-up vs fp32_highest; time / {FP16}'s")
        for m, q in p.items():
            print(f"  {m:18s} {q['compute_s'] * 1e3:6.3f} {q['memory_s'] * 1e3:6.3f} {q['launch_s'] * 1e3:6.3f}   "
                  f"{q['roofline_s'] * 1e3:6.3f} | {q['additive_s'] * 1e3:6.3f}   "
                  f"x{q.get('speedup_roofline_vs_fp32', float('nan')):.2f} | "
                  f"x{q.get('speedup_additive_vs_fp32', float('nan')):.2f}   "
                  f"{q.get('time_roofline_vs_fp16', float('nan')):.2f} | "
                  f"{q.get('time_additive_vs_fp16', float('nan')):.2f}")
    if a.time:
        res["measured"] = runner.bench_steps(size, a.modes, a.reps, a.inner, res["meta"])
        ref, f16 = (res["measured"]["modes"].get(k) for k in ("fp32_highest", FP16))
        print(f"\nmeasured on {res['meta']['device_kind']}: step ms median [p25, p75], speed-up vs fp32_highest, "
              f"time / {FP16}'s")
        for m, r in res["measured"]["modes"].items():
            st = r["step_s"]
            up = f"x{ref['step_s']['median'] / st['median']:.2f}" if ref else ""
            vs = f"{st['median'] / f16['step_s']['median']:.2f}" if f16 else ""
            print(f"  {m:20s} {st['median'] * 1e3:8.3f} [{st['p25'] * 1e3:.3f}, {st['p75'] * 1e3:.3f}]  {up}  {vs}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res
