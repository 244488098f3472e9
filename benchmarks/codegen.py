"""What XLA generates for a matrix case's train step, and how long it takes: kernels, LLVM IR
bytes, object files, and trace / lower / compile seconds (medians of repeated builds).

    python -m benchmarks.codegen [--problems poisson1d cavity] [--placement default]
        [--modes per_order per_term] [--reps 5] [--out FILE]
    python -m benchmarks.codegen --compare OLD.json NEW.json
    python -m benchmarks.codegen --base OLD1.json OLD2.json --new NEW1.json NEW2.json

Each case runs in its own process, with ``XLA_FLAGS=--xla_dump_to`` set before JAX starts: the
IR XLA dumps (``*.ir-no-opt.ll``, before LLVM's optimisation) is deterministic for a program,
so it measures a change in what the compiler is given without the noise of a timing, and on
this CPU it tracks the compile time (code generation is most of it). To compare two commits,
run it from a worktree of each (``git worktree add /tmp/old REV``; ``cd /tmp/old && python
/path/to/benchmarks/codegen.py``: it imports the ``benchmarks.matrix`` of the directory it runs
in), twice each, alternating: the seconds drift with the machine's load, the bytes do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

_WORKER = r"""
import json, os, re, statistics, sys, time
import jax, jax.numpy as jnp
from unittest import mock
from benchmarks import matrix
from benchmarks.problems import PROBLEMS, make_batch
from jaxamp.models import FullyConnected
name, placement, mode, reps, dump = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
p = PROBLEMS[name]
params = FullyConnected(out_features=len(p.outputs), layer_size=64, nr_layers=4).init(
    jax.random.PRNGKey(0), jnp.zeros(len(p.inputs)))
batch = make_batch(p, 2000, 500)
seen = {}
real_jit = jax.jit
class Capture:  # the step and its arguments, as build_case compiles them
    def __init__(self, f): self.f = f
    def lower(self, *a):
        seen["f"], seen["a"] = self.f, a
        return real_jit(self.f).lower(*a)
with mock.patch.object(jax, "jit", Capture):
    case = matrix.build_case(p, placement, mode, params, batch, 4, 64)
hlo = case.compiled.as_text()
rows = []
for _ in range(reps):  # a fresh function each time: nothing cached but the library's own traces
    t0 = time.perf_counter(); traced = real_jit(lambda *x: seen["f"](*x)).trace(*seen["a"])
    t1 = time.perf_counter(); lowered = traced.lower()
    t2 = time.perf_counter(); lowered.compile(); t3 = time.perf_counter()
    rows.append((t1 - t0, t2 - t1, t3 - t2))
files = [f for f in os.listdir(dump) if "jit_step" in f]
ir = sum(os.path.getsize(os.path.join(dump, f)) for f in files if f.endswith(".ir-no-opt.ll"))
entry = hlo[hlo.index("ENTRY"):]
out = {"kernels": entry.count(" fusion(") + entry.count(" dot("), "llvm_ir_bytes": ir,
       "objects": sum(f.endswith(".o") for f in files),
       **{k: statistics.median(r[i] for r in rows) for i, k in enumerate(("trace_s", "lower_s", "compile_s"))}}
print("RESULT " + json.dumps(out))
"""


def run_case(problem: str, placement: str, mode: str, reps: int) -> Dict[str, Any]:
    """One case in a fresh process (its XLA dump in a temporary directory)."""
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}", JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
        done = subprocess.run([sys.executable, "-c", _WORKER, problem, placement, mode, str(reps), dump], env=env,
                              capture_output=True, text=True, check=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


FIELDS = ("kernels", "llvm_ir_bytes", "objects", "compile_s", "total_s")


def _mean_cases(paths: List[str]) -> Dict[str, Dict[str, float]]:
    """Each case's fields averaged over the result files (``total_s``: trace + lower + compile)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f)["cases"])
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    out = {}
    for k in keys:
        rows = [{**r[k], "total_s": r[k]["trace_s"] + r[k]["lower_s"] + r[k]["compile_s"]} for r in runs]
        out[k] = {f: sum(row[f] for row in rows) / len(rows) for f in FIELDS}
    return out


def compare(old: Any, new: Any) -> Dict[str, Dict[str, float]]:
    """``{case: {field: new / old}}`` over the cases both sides have; ``old`` and ``new`` are a
    result file each, or lists of them (runs of one commit, averaged first)."""
    a = _mean_cases([old] if isinstance(old, str) else list(old))
    b = _mean_cases([new] if isinstance(new, str) else list(new))
    return {k: {f: b[k][f] / a[k][f] for f in FIELDS} for k in b if k in a}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", nargs="+", default=["poisson1d", "cavity"])
    ap.add_argument("--placement", default="default")
    ap.add_argument("--modes", nargs="+", default=["plain", "per_order", "per_term"])
    ap.add_argument("--reps", type=int, default=5, help="builds timed per case (median)")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="ratios of two result files")
    ap.add_argument("--base", nargs="+", help="with --new: ratios of the runs' means (runs of two commits)")
    ap.add_argument("--new", nargs="+")
    args = ap.parse_args(argv)
    if args.compare or (args.base and args.new):
        rows = compare(*args.compare) if args.compare else compare(args.base, args.new)
        for k, r in rows.items():
            print(f"{k}: " + ", ".join(f"{f} {v:.3f}" for f, v in r.items()))
        return rows
    import jax

    cases = {f"{p}/{args.placement}/{m}": run_case(p, args.placement, m, args.reps)
             for p in args.problems for m in args.modes}
    for k, r in cases.items():
        print(f"{k}: {r['kernels']} kernels, {r['llvm_ir_bytes'] / 1e6:.3f} MB IR, {r['objects']} objects, "
              f"compile {r['compile_s']:.2f} s (trace {r['trace_s']:.2f} s)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"meta": {"jax": jax.__version__, "commit": commit, "cwd": os.getcwd(), "reps": args.reps}, "cases": cases}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
