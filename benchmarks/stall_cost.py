"""What the in-step stall report costs: ``make_train_step(on_stall="warn")`` against ``on_stall=None``.

    python -m benchmarks.stall_cost [--problems poisson1d cavity unsteady_ns ks] [--reps 11] [--out FILE]

The report is a host callback inside a ``lax.cond`` taken only when a run stalls; XLA still
compiles the callback into the step. Per problem of :mod:`benchmarks.matrix` (default placement,
per-order DerivScaler): the step compiled both ways, timed in interleaved rounds; the ratio is
the paired median of warn / none.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict

import jax
import jax.numpy as jnp

from jaxamp.models import FullyConnected

from benchmarks import timing
from benchmarks.matrix import clocked, build_case
from benchmarks.problems import PROBLEMS, make_batch


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    out: Dict[str, Any] = {"benchmark": "stall_cost", "info": timing.device_info(), "reps": args.reps, "problems": {}}
    for name in args.problems:
        problem = PROBLEMS[name]
        net = FullyConnected(out_features=len(problem.outputs), layer_size=64, nr_layers=4)
        params = net.init(jax.random.PRNGKey(0), jnp.zeros(len(problem.inputs)))
        batch = make_batch(problem, 2000, 500)
        cases = {k: build_case(problem, "default", "per_order", params, batch, 4, 64, on_stall=v)
                 for k, v in (("warn", "warn"), ("none", None))}
        cpu = {k: [] for k in cases}
        wall = timing.interleaved({k: clocked(c, batch, 3, cpu[k]) for k, c in cases.items()}, args.reps)
        ratio = timing.paired_ratio(wall["warn"], wall["none"])
        out["problems"][name] = {"warn_over_none": ratio, "step_s": {k: timing.stats(v) for k, v in wall.items()}}
        print(f"{name}: step time with the in-step report / without: {ratio['median']:.3f} "
              f"[{ratio['p25']:.3f}, {ratio['p75']:.3f}]", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
