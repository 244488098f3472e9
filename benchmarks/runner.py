"""``python -m benchmarks``: step time per precision mode, JAX vs torch_ref, derivative
engines by order, and memory -- measured interleaved in one process, written as JSON.

See ``python -m benchmarks --help`` and the presets in :data:`PRESETS`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp

import jaxamp

from benchmarks import engines as E
from benchmarks import ldc, timing
from benchmarks.report import print_tables

PRESETS: Dict[str, Dict[str, Any]] = {
    "smoke": dict(sizes=["2x16:32/16/16"], modes=["fp16_plain", "fp16_scaled_order"],
                  reverse_modes=["fp16_scaled_order"],
                  reps=2, inner=1, torch=True, torch_modes=["fp16_scaled_order"], torch_compile=False,
                  orders_size="2x16:16", max_order=1, orders_reps=2, memory_modes=["fp16_scaled_order"]),
    "cpu": dict(sizes=["4x128:1000/200/200"], modes=list(ldc.MODES),
                reverse_modes=["fp32_highest", "fp16_scaled_order"], reps=5, inner=1, torch=True,
                torch_modes=["fp32_highest", "fp16_scaled_order"], torch_compile=True,
                orders_size="4x128:256", max_order=4, orders_reps=5, memory_modes=list(ldc.MODES)),
    "gpu": dict(sizes=["6x512:4000/1000/1000"], modes=list(ldc.MODES),
                reverse_modes=["fp32_highest", "fp16_scaled_order"], reps=15, inner=5, torch=False,
                torch_modes=[], torch_compile=False, orders_size="6x512:4000", max_order=4, orders_reps=10,
                memory_modes=list(ldc.MODES)),
}
# The compute dtype behind each mode, to look up the device's peak throughput.
PEAK_KEY = {"fp32_highest": "float32", "fp32_default": "tf32", "bf16": "bfloat16"}


def parse_size(text: str) -> ldc.LDCSize:
    """``"6x512:4000/1000/1000"`` -> layers 6, width 512, interior/lid/no-slip points."""
    try:
        net, pts = text.split(":")
        layers, width = (int(v) for v in net.split("x"))
        n = [int(v) for v in pts.split("/")]
        n_int, n_lid, n_ns = (n + [max(1, n[0] // 4)] * 2)[:3]
    except ValueError:
        raise ValueError(f"--sizes: {text!r} is not LAYERSxWIDTH:INTERIOR[/LID/NOSLIP], e.g. 4x128:1000/200/200.")
    return ldc.LDCSize(nr_layers=layers, layer_size=width, n_interior=n_int, n_lid=n_lid, n_noslip=n_ns)


_COMPILED: Dict[Any, Any] = {}  # (size, mode, method) -> (LDCStep, compiled, compile s), shared by sections
REVERSE = "@reverse"  # case-name suffix: the same mode with Derivatives(method="reverse")


def compile_step(s: ldc.LDCStep):
    t = time.perf_counter()
    with s.precision():
        compiled = jax.jit(s.step).lower(s.state, s.batch).compile()
    return compiled, time.perf_counter() - t


def cached_step(mode: str, size: ldc.LDCSize, params: Any, points: Any, method: str = "forward"):
    """Build and compile the LDC step of ``mode`` once per run (same weights and points)."""
    if (size, mode, method) not in _COMPILED:
        s = ldc.build_step(mode, size, params, points, method=method)
        _COMPILED[(size, mode, method)] = (s, *compile_step(s))
    return _COMPILED[(size, mode, method)]


def bench_steps(size: ldc.LDCSize, modes: List[str], reps: int, inner: int, info: Dict[str, Any],
                reverse_modes: Sequence[str] = ()) -> Dict[str, Any]:
    """Interleaved step times of every mode on shared weights and points, with FLOPs and ratios.
    Modes use the default (forward) derivative engine; ``reverse_modes`` are timed again with
    nested reverse mode, as ``"<mode>@reverse"``."""
    params, points = ldc.init_params(size), ldc.make_points(size)
    runs, out = {}, {"size": size.label, "modes": {}}
    cases = [(m, "forward") for m in modes] + [(m, "reverse") for m in reverse_modes]
    for mode, method in cases:
        s, compiled, compile_s = cached_step(mode, size, params, points, method)
        mode = mode + REVERSE if method == "reverse" else mode
        holder = {"state": s.state}

        def run(compiled=compiled, holder=holder, batch=s.batch):
            holder["state"], metrics = compiled(holder["state"], batch)
            return metrics["loss"]

        runs[mode] = timing.timer(run, inner)
        out["modes"][mode] = {"compile_s": compile_s, **timing.cost_of(compiled),
                              "xla_memory": timing.memory_of(compiled)}
    samples = timing.interleaved(runs, reps)
    for mode, times in samples.items():
        m = out["modes"][mode]
        m["step_s"] = timing.stats(times)
        m["samples_s"] = times
        fl = m["flops"]
        m["tflops"] = fl / m["step_s"]["median"] / 1e12 if fl else None
        peak = timing.peak_flops(info["device_kind"], PEAK_KEY.get(mode.replace(REVERSE, ""), "float16"))
        m["peak_tflops"] = peak / 1e12 if peak else None
        m["peak_fraction"] = m["tflops"] * 1e12 / peak if (peak and m["tflops"]) else None
    pairs = {
        "scaler_overhead_order": ("fp16_scaled_order", "fp16_plain"),
        "scaler_overhead_term": ("fp16_scaled_term", "fp16_plain"),
        "scaler_only_overhead_order": ("fp16_scaled_order", "fp16_noscale"),
        "scaler_only_overhead_term": ("fp16_scaled_term", "fp16_noscale"),
        "speedup_fp16_scaled_vs_fp32_highest": ("fp32_highest", "fp16_scaled_order"),
        "speedup_bf16_vs_fp32_highest": ("fp32_highest", "bf16"),
        "speedup_fp32_default_vs_highest": ("fp32_highest", "fp32_default"),
        **{f"speedup_forward_vs_reverse_{m}": (m + REVERSE, m) for m in reverse_modes},
    }
    out["ratios"] = {k: timing.paired_ratio(samples[a], samples[b]) for k, (a, b) in pairs.items()
                     if a in samples and b in samples}
    return out


def bench_torch(size: ldc.LDCSize, modes: List[str], reps: int, use_compile: bool) -> Dict[str, Any]:
    """JAX (jit) vs torch_ref eager (and torch.compile'd network) on identical weights/points."""
    from benchmarks import torch_bench

    why = torch_bench.available()
    if why:
        return {"skipped": f"torch_ref not usable: {why}"}
    import torch

    params, points = ldc.init_params(size), ldc.make_points(size)
    runs, out = {}, {"size": size.label, "torch": torch.__version__, "threads": torch.get_num_threads(), "modes": {}}
    for mode in modes:
        s, compiled, _ = cached_step(mode, size, params, points)
        holder = {"state": s.state}

        def run(compiled=compiled, holder=holder, batch=s.batch):
            holder["state"], metrics = compiled(holder["state"], batch)
            return metrics["loss"]

        runs[f"jax/{mode}"] = timing.timer(run, 1)
        eager, _ = torch_bench.build_torch_step(mode, size, params, points)
        runs[f"torch_eager/{mode}"] = timing.timer(eager, 1)
        if use_compile:
            try:
                comp, _ = torch_bench.build_torch_step(mode, size, params, points, compile_model=True)
                t = time.perf_counter()
                comp()
                out["modes"].setdefault(mode, {})["torch_compile_first_s"] = time.perf_counter() - t
                runs[f"torch_compile/{mode}"] = timing.timer(comp, 1)
            except Exception as e:  # torch.compile needs a C++ toolchain; report, don't fail
                out["modes"].setdefault(mode, {})["torch_compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    samples = timing.interleaved(runs, reps)
    for name, times in samples.items():
        kind, mode = name.split("/")
        out["modes"].setdefault(mode, {})[f"{kind}_s"] = timing.stats(times)
        if kind != "jax":
            out["modes"][mode][f"ratio_jax_over_{kind}"] = timing.paired_ratio(samples[f"jax/{mode}"], times)
    return out


def bench_orders(text: str, max_order: int, reps: int, deadline: float = math.inf) -> Dict[str, Any]:
    """Forward derivatives + weight gradient by order, per engine, fp16 scaled and unscaled.

    Stops adding higher orders once ``time.perf_counter()`` passes ``deadline``."""
    net, n = text.split(":")
    layers, width = (int(v) for v in net.split("x"))
    x = jax.random.uniform(jax.random.PRNGKey(1), (int(n), 2), minval=-0.05, maxval=0.05)
    fp16 = jaxamp.AmpConfig(dtype="float16")
    configs = {"fp16_scaled": (fp16, fp16), "fp16_unscaled": (fp16, None)}
    runs, out = {}, {"size": text, "cases": {}}
    for order in range(1, max_order + 1):
        if time.perf_counter() > deadline:
            out["truncated"] = f"orders >= {order} skipped: time budget spent"
            break
        ders = E.pure_derivatives(order)
        for cfg, (net_amp, eng_amp) in configs.items():
            model = ldc.FullyConnected.from_amp(net_amp, out_features=1, layer_size=width, nr_layers=layers)
            params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))
            fn = lambda p, z, model=model: model.apply(p, z)  # noqa: E731
            ref_vals = None
            for kind in E.KINDS:
                if kind == "jet" and eng_amp is not None:
                    continue  # Taylor mode cannot reproduce per-order scales (see engines.py)
                eng = E.make_engine(kind, fn, inputs=("x", "y"), outputs=("u",), derivatives=ders, amp=eng_amp)
                scales = {k: jnp.float32(1.0) for k in eng.scaler_keys}

                def loss(p, eng=eng, scales=scales):
                    vals, found = jaxamp.scaled(eng)(scales, p, x)  # the engine's scales and flags
                    return sum(jnp.mean(v**2) for v in vals.values()), (vals, found)

                f = jax.jit(jax.value_and_grad(loss, has_aux=True))
                t = time.perf_counter()
                (_, (vals, _)), _ = jax.block_until_ready(f(params))
                name = f"{cfg}/{kind}/{order}"
                case = {"compile_and_first_s": time.perf_counter() - t}
                if kind == "reverse":
                    ref_vals = vals
                else:
                    case["max_rel_diff_vs_reverse"] = E.max_rel_diff(vals, ref_vals)
                out["cases"][name] = case
                runs[name] = timing.timer(lambda f=f, p=params: f(p), 1)
    samples = timing.interleaved(runs, reps)
    for name, times in samples.items():
        out["cases"][name]["time_s"] = timing.stats(times)
        cfg, kind, order = name.split("/")
        if kind != "reverse":
            out["cases"][name]["ratio_vs_reverse"] = timing.paired_ratio(times, samples[f"{cfg}/reverse/{order}"])
    return out


def memory_child(mode: str, size_text: str) -> Dict[str, Any]:
    """Run in a fresh process: RSS before compiling, peak RSS after compile + 3 steps."""
    size = parse_size(size_text)
    s = ldc.build_step(mode, size)
    jax.block_until_ready(s.state)
    base = timing.rss_bytes()
    compiled, _ = compile_step(s)
    st = s.state
    for _ in range(3):
        st, m = compiled(st, s.batch)
    jax.block_until_ready(st)
    return {"rss_before_compile_bytes": base, "peak_rss_bytes": timing.peak_rss_bytes(),
            "device_peak_bytes": timing.device_peak_bytes()}


def bench_memory(size_text: str, modes: List[str], deadline: float = math.inf) -> Dict[str, Any]:
    """Each mode in a fresh subprocess (honest peak RSS / device peak; costs a compile each)."""
    out = {"size": size_text, "method": "fresh subprocess per mode: peak RSS (VmHWM) and RSS growth "
           "from before compile; device peak_bytes_in_use where the backend reports it", "modes": {}}
    for mode in modes:
        if time.perf_counter() > deadline:
            out["modes"][mode] = {"error": "skipped: time budget spent"}
            continue
        cmd = [sys.executable, "-m", "benchmarks", "--memory-child", mode, "--sizes", size_text]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            out["modes"][mode] = {"error": p.stderr[-500:]}
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["rss_growth_bytes"] = r["peak_rss_bytes"] - r["rss_before_compile_bytes"]
        out["modes"][mode] = r
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument("--sizes", nargs="+", help="override, e.g. 4x128:1000/200/200 6x512:4000/1000/1000")
    ap.add_argument("--modes", nargs="+", choices=ldc.MODES)
    ap.add_argument("--reverse-modes", nargs="*", choices=ldc.MODES,
                    help="modes timed again with Derivatives(method='reverse'), for the engine ratio")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--inner", type=int, help="steps per timed sample (longer samples: less timer noise)")
    ap.add_argument("--orders-size", help="override, e.g. 4x128:256 (net LAYERSxWIDTH : points)")
    ap.add_argument("--max-order", type=int, choices=[1, 2, 3, 4])
    ap.add_argument("--memory-modes", nargs="+", choices=ldc.MODES)
    ap.add_argument("--sections", nargs="+", default=["step", "torch", "orders", "memory"],
                    choices=["step", "torch", "orders", "memory"])
    ap.add_argument("--time-budget", type=float, default=math.inf, help="seconds; later sections are skipped")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.memory_child:
        print(json.dumps(memory_child(a.memory_child, a.sizes[0])))
        return {}
    cfg = dict(PRESETS[a.preset])
    for key in ("sizes", "modes", "reverse_modes", "reps", "inner", "orders_size", "max_order", "memory_modes"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    for key in ("reps", "inner"):
        if cfg[key] < 1:
            ap.error(f"--{key}={cfg[key]} must be >= 1")
    sizes = [parse_size(t) for t in cfg["sizes"]]
    t0, info = time.perf_counter(), timing.device_info()
    res: Dict[str, Any] = {"meta": {**info, "preset": a.preset, "argv": sys.argv if argv is None else argv,
                                    "config": cfg, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}}

    def budget_left(section: str) -> bool:
        if time.perf_counter() - t0 < a.time_budget:
            return True
        res[section] = {"skipped": f"time budget of {a.time_budget} s spent"}
        return False

    if "step" in a.sections:
        res["step"] = [bench_steps(s, cfg["modes"], cfg["reps"], cfg["inner"], info, cfg["reverse_modes"])
                       for s in sizes]
    if "torch" in a.sections and cfg["torch"] and budget_left("torch"):
        res["torch"] = bench_torch(sizes[0], cfg["torch_modes"], cfg["reps"], cfg["torch_compile"])
    if "orders" in a.sections and budget_left("orders"):
        res["orders"] = bench_orders(cfg["orders_size"], cfg["max_order"], cfg["orders_reps"], t0 + a.time_budget)
    if "memory" in a.sections and budget_left("memory"):
        res["memory"] = bench_memory(cfg["sizes"][0], cfg["memory_modes"], t0 + a.time_budget)
    res["meta"]["total_s"] = time.perf_counter() - t0
    print_tables(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res
