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
import time
from typing import Any, Dict

import jax
import jax.numpy as jnp
import optax

import jaxamp
from jaxamp.models import FullyConnected

from benchmarks import timing
from benchmarks.matrix import _clocked, case_amp, Case
from benchmarks.problems import PROBLEMS, make_batch


def build(problem, params, batch, on_stall) -> Case:
    """The default-placement, per-order train step of ``problem`` with ``on_stall``."""
    amp = case_amp("default", "per_order")
    model = FullyConnected.from_amp(amp, out_features=len(problem.outputs), layer_size=64, nr_layers=4,
                                    activation="tanh")  # fmt: skip
    engine = jaxamp.Derivatives(lambda p, x: model.apply(p, x), inputs=problem.inputs, outputs=problem.outputs,
                                derivatives=problem.derivatives, amp=amp)  # fmt: skip

    def loss_fn(p, b):
        d = engine(p, b["interior"])
        terms = {k: jnp.mean(r**2) for k, r in problem.residuals(d, b["interior"]).items()}
        return sum(terms.values()), terms

    opt = optax.adam(1e-3)
    state = jaxamp.train.TrainState.create(params=params, optimizer=opt, amp=amp, engines=[engine])
    step = jaxamp.train.make_train_step(loss_fn, opt, amp=amp, on_stall=on_stall)
    t = time.perf_counter()
    compiled = jax.jit(step).lower(state, batch).compile()
    return Case(str(on_stall), state, compiled, time.perf_counter() - t)


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
        cases = {k: build(problem, params, batch, v) for k, v in (("warn", "warn"), ("none", None))}
        cpu = {k: [] for k in cases}
        wall = timing.interleaved({k: _clocked(c, batch, 3, cpu[k]) for k, c in cases.items()}, args.reps)
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
