"""``python -m benchmarks.merge_cost``: one matrix case's train step with the interpreter's merge
off and on (``make_train_step(merge=...)``), timed interleaved, with XLA's FLOPs and buffers.

    python -m benchmarks.merge_cost --problem cavity --placement all_fp16 --mode per_term \\
        [--n 1000 2000] [--reps 15] [--profile] [--out FILE]

``--profile`` also records one profiler trace in which the two programs alternate, and sums the
durations of the executed XLA operations of each program by kind (the name without its
``.<n>`` suffix; ``ynn_fusion`` are XLA CPU's library fusions): where the time of one program
goes against the other's. Per-operation durations are wall intervals: other load on the host
stretches them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile
from typing import Any, Dict, List, Optional

import jax

from benchmarks import timing
from benchmarks.matrix import MODES, PLACEMENTS, PRESETS, build_case
from benchmarks.problems import PROBLEMS, make_batch
from jaxamp.models import FullyConnected


def op_profile(cases: Dict[str, Any], batch: Any, rounds: int) -> Dict[str, Dict[str, float]]:
    """Milliseconds per call of each operation kind, per case, from one trace of alternating calls."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for r in range(rounds):
                for name in sorted(cases, reverse=bool(r % 2)):
                    with jax.profiler.TraceAnnotation(f"call:{name}"):
                        jax.block_until_ready(cases[name].compiled(cases[name].state, batch))
        path = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X"]
    calls = [(e["ts"], e["ts"] + e["dur"], e["name"][5:]) for e in spans if e["name"].startswith("call:")]
    kinds: Dict[str, collections.Counter] = {name: collections.Counter() for name in cases}
    for e in spans:
        name = e["name"]
        if not ("fusion" in name or name.startswith(("dot", "wrapped_", "copy", "transpose"))):
            continue
        for start, end, case in calls:
            if start <= e["ts"] <= end:
                kinds[case][name.rsplit(".", 1)[0]] += e.get("dur", 0) / 1e3 / rounds
    return {case: {k: round(v, 3) for k, v in c.most_common()} for case, c in kinds.items()}


def bench(problem: Any, cfg: Dict[str, Any], a: argparse.Namespace) -> Dict[str, Any]:
    """Merge off and on for one problem size: compile, cost, interleaved times, optional profile."""
    net = FullyConnected(out_features=len(problem.outputs), layer_size=cfg["width"], nr_layers=cfg["layers"])
    params = net.init(jax.random.PRNGKey(0), jax.numpy.zeros(len(problem.inputs)))
    batch = make_batch(problem, cfg["n"], cfg["nb"])
    cases = {f"merge={m}": build_case(problem, a.placement, a.mode, params, batch, cfg["layers"], cfg["width"], merge=m)
             for m in (False, True)}
    runs, out = {}, {}
    for name, case in cases.items():
        runs[name] = timing.timer(lambda c=case: c.compiled(c.state, batch)[1]["loss"], cfg["inner"])
        out[name] = {"compile_s": round(case.compile_s, 3), **timing.cost_of(case.compiled),
                     **timing.memory_of(case.compiled)}
    samples = timing.interleaved(runs, a.reps)
    for name in cases:
        out[name]["time_s"] = timing.stats(samples[name])
        out[name]["time_per_point_us"] = round(out[name]["time_s"]["median"] * 1e6 / cfg["n"], 3)
    res = {"cases": out, "time_on_over_off": timing.paired_ratio(samples["merge=True"], samples["merge=False"]),
           "flops_on_over_off": round(out["merge=True"]["flops"] / out["merge=False"]["flops"], 4)}
    if a.profile:
        res["op_ms_per_call"] = op_profile(cases, batch, rounds=8)
    return res


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.merge_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--problem", choices=list(PROBLEMS), default="cavity")
    ap.add_argument("--placement", choices=list(PLACEMENTS), default="all_fp16")
    ap.add_argument("--mode", choices=list(MODES), default="per_term")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--n", type=int, nargs="+", default=None, help="interior point counts (default: the preset's)")
    ap.add_argument("--reps", type=int, default=15, help="interleaved rounds")
    ap.add_argument("--profile", action="store_true", help="also sum the profiled operations by kind")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error(f"--reps={a.reps} must be >= 1")
    if a.n is not None and min(a.n) < 1:
        ap.error(f"--n={a.n} must all be >= 1")
    preset, problem = PRESETS[a.preset], PROBLEMS[a.problem]
    record: Dict[str, Any] = {
        "benchmark": "merge_cost", "info": timing.device_info(),
        "config": {"problem": a.problem, "placement": a.placement, "mode": a.mode, "preset": a.preset, **preset,
                   "reps": a.reps},
        "results": {},
    }
    for n in a.n or [preset["n"]]:
        res = record["results"][str(n)] = bench(problem, {**preset, "n": n}, a)
        r, c = res["time_on_over_off"], res["cases"]
        print(f"{a.problem}/{a.placement}/{a.mode} n={n}: merge on / off {r['median']:.3f} [{r['p25']:.3f}, "
              f"{r['p75']:.3f}], FLOPs {res['flops_on_over_off']:.3f}, us per point off "
              f"{c['merge=False']['time_per_point_us']:.2f} on {c['merge=True']['time_per_point_us']:.2f}", flush=True)
        for name, kinds in res.get("op_ms_per_call", {}).items():
            print(f"  {name}: {sum(kinds.values()):.2f} ms of operations per call; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in list(kinds.items())[:6]))
    timing.save(record, a.out)
    return record


if __name__ == "__main__":
    main()
