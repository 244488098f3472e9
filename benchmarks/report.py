"""Plain-text tables of a benchmark result (the dict the runner writes as JSON)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional


def _ms(s: Optional[Dict[str, float]]) -> str:
    if not s:
        return "-"
    return f"{s['median'] * 1e3:9.2f} [{s['p25'] * 1e3:.2f}, {s['p75'] * 1e3:.2f}]"


def _ratio(s: Optional[Dict[str, float]]) -> str:
    return f"{s['median']:.3f} [{s['p25']:.3f}, {s['p75']:.3f}]" if s else "-"


def _mib(b: Optional[int]) -> str:
    return f"{b / 2**20:.1f}" if b is not None else "-"


def _table(title: str, header: List[str], rows: List[List[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    print(f"\n== {title}")
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def print_tables(res: Dict[str, Any]) -> None:
    m = res["meta"]
    print(f"backend={m['backend']} device={m['device_kind']} jax={m['jax']} preset={m['preset']} "
          "times: median [p25, p75] over interleaved repetitions")
    for block in res.get("step", []):
        rows = []
        for mode, r in block["modes"].items():
            frac = f"{r['peak_fraction'] * 100:.1f}%" if r.get("peak_fraction") else "-"
            tf = f"{r['tflops']:.4f}" if r.get("tflops") else "-"
            rows.append([mode, _ms(r["step_s"]), f"{r['compile_s']:.1f}", f"{(r['flops'] or 0) / 1e9:.2f}", tf, frac,
                         _mib(r["xla_memory"]["temp_bytes"])])
        _table(f"LDC step {block['size']} ({m['backend']})",
               ["mode", "step ms", "compile s", "GFLOP", "TFLOP/s", "of peak", "XLA temp MiB"], rows)
        _table("ratios (paired per repetition)", ["ratio", "median [p25, p75]"],
               [[k, _ratio(v)] for k, v in block["ratios"].items()])
    t = res.get("torch")
    if t:
        if "skipped" in t:
            print(f"\n== JAX vs torch_ref: skipped ({t['skipped']})")
        else:
            rows = []
            for mode, r in t["modes"].items():
                rows.append([mode, _ms(r.get("jax_s")), _ms(r.get("torch_eager_s")), _ms(r.get("torch_compile_s")),
                             _ratio(r.get("ratio_jax_over_torch_eager")), _ratio(r.get("ratio_jax_over_torch_compile")),
                             r.get("torch_compile_error", "")[:60]])
            _table(f"JAX vs torch_ref {t['size']} (torch {t['torch']}, {t['threads']} threads)",
                   ["mode", "jax ms", "torch eager ms", "torch compile ms", "jax/eager", "jax/compile", "note"], rows)
    o = res.get("orders")
    if o and "cases" in o:
        rows = [[k, _ms(c.get("time_s")), _ratio(c.get("ratio_vs_reverse")),
                 f"{c['max_rel_diff_vs_reverse']:.1e}" if "max_rel_diff_vs_reverse" in c else "ref"]
                for k, c in o["cases"].items()]
        _table(f"derivatives + weight grad by order, net {o['size']} points", ["config/engine/order", "ms",
               "vs reverse", "max rel diff"], rows)
        if "truncated" in o:
            print(o["truncated"])
    mem = res.get("memory")
    if mem and "modes" in mem:
        rows = [[k, _mib(r.get("peak_rss_bytes")), _mib(r.get("rss_growth_bytes")), _mib(r.get("device_peak_bytes")),
                 r.get("error", "")[-60:]] for k, r in mem["modes"].items()]
        _table(f"memory {mem['size']} ({mem['method']})", ["mode", "peak RSS MiB", "RSS growth MiB",
               "device peak MiB", "error"], rows)
    for sec in ("torch", "orders", "memory"):
        if isinstance(res.get(sec), dict) and "skipped" in res[sec] and sec != "torch":
            print(f"\n== {sec}: skipped ({res[sec]['skipped']})")
