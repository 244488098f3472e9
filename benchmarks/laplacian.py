"""Collapsed Taylor mode vs the uncollapsed Laplacians: time, XLA FLOPs, compile time, buffer sizes.

    python -m benchmarks.laplacian --out benchmarks/results/laplacian.json

A plain tanh MLP (``--layers`` x ``--width``, float32) evaluated at ``--points`` points
(``vmap``); for each input dimension ``d`` in ``--dims`` and each method of
:func:`jaxamp.laplacian` (``reverse``: diagonal of ``jax.hessian``; ``forward``: nested
``jax.jvp``; ``taylor``: one second-order Taylor propagation per direction; ``collapsed``: one
summed second-order propagation), three workloads:

- ``value``: the Laplacian at every point, outside :func:`jaxamp.scaled` (every scale 1, what a
  JAX user's own code compiles to);
- ``scaled_value``: the same under ``jaxamp.scaled`` with scales ``{"1": 2**-3, "2": 2**-7}``
  (the seeds differ from 1, and the overflow checks are computed);
- ``scaled_grad``: ``jax.value_and_grad`` of ``mean(lap**2)`` with respect to the parameters
  under ``jaxamp.scaled`` (a PINN training step's derivative work);
- ``engine_grad``: the same step through :class:`jaxamp.Derivatives`, the engine under
  ``jaxamp.scaled`` with the same scales: ``collapsed`` asks for ``"u__lap"``, ``forward``
  (the default engine: one tangent per pure second order) and ``reverse`` (nested reverse
  mode) for the ``d`` pure second derivatives ``u__xi__xi``, summed (``taylor`` is not an
  engine method: not run).
- ``dropin_vs_engine``: ``scaled_grad`` and ``engine_grad`` side by side, all six programs timed
  interleaved in one run, the ratios drop-in over engine paired per round, for the pairs that
  compute the same way (``PAIRS``): ``reverse``/``reverse``, the drop-in's ``taylor`` / the
  engine's ``forward`` (which takes one Taylor propagation per pure second order), and
  ``collapsed``/``collapsed`` (both defaults).

The methods of one (workload, d) are timed interleaved in one run (:mod:`benchmarks.timing`:
each round runs every method once in rotating order; the medians and per-round paired ratios
are reported); FLOPs and bytes are XLA's cost analysis of the compiled program; the compile
time is that of ``jax.jit(f).lower(...).compile()``. The record names the machine and versions.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from benchmarks import timing
from jaxamp import laplacian

METHODS = ("reverse", "forward", "taylor", "collapsed")
UNCOLLAPSED = ("reverse", "forward", "taylor")
WORKLOADS = ("value", "scaled_value", "scaled_grad", "engine_grad", "dropin_vs_engine")
PAIRS = (("reverse", "reverse"), ("taylor", "forward"), ("collapsed", "collapsed"))  # (drop-in, engine)
SCALES = {"1": 2.0**-3, "2": 2.0**-7}


def init_mlp(d: int, width: int, layers: int, seed: int = 0) -> List[Any]:
    sizes = [d] + [width] * layers + [1]
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed + i))
        params.append((jax.random.normal(k1, (a, b)) / np.sqrt(a), 0.1 * jax.random.normal(k2, (b,))))
    return params


def mlp(params: List[Any], x: jax.Array) -> jax.Array:
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return h[0]


def engine_loss(method: str, d: int) -> Callable:
    inputs = tuple(f"x{i}" for i in range(d))
    seconds = tuple(f"u__{x}__{x}" for x in inputs)
    eng = jaxamp.Derivatives(lambda p, x: mlp(p, x)[None], inputs=inputs, outputs=("u",), amp=jaxamp.AmpConfig(),
                             derivatives=("u__lap",) if method == "collapsed" else seconds,
                             method="forward" if method == "collapsed" else method)
    names = ("u__lap",) if method == "collapsed" else seconds

    def loss(p, x):
        values, found = jaxamp.scaled(eng)(SCALES, p, x)
        return jnp.mean(sum(values[n] for n in names) ** 2), found

    return jax.value_and_grad(loss, has_aux=True)


def workload(name: str, method: str, d: int) -> Callable:
    if name == "engine_grad":
        return engine_loss(method, d)
    lap = jax.vmap(laplacian(mlp, 1, method=method), (None, 0))
    if name == "value":
        return lap
    if name == "scaled_value":
        scaled = jaxamp.scaled(lap)
        return lambda p, x: scaled(SCALES, p, x)
    loss = jaxamp.scaled(lambda p, x: jnp.mean(lap(p, x) ** 2))
    return jax.value_and_grad(lambda p, x: loss(SCALES, p, x), has_aux=True)


def compiled_run(fn: Callable, params: Any, x: jax.Array, inner: int):
    """Compile ``fn`` for ``(params, x)``; return its timer and its compile/cost/buffer record."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(params, x).compile()
    compile_s = time.perf_counter() - start
    record = {"compile_s": round(compile_s, 3), **timing.cost_of(compiled), **timing.memory_of(compiled)}
    return timing.timer(lambda: compiled(params, x), inner), record


def bench_pair(d: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Drop-in over engine for each of ``PAIRS``, every program in one interleaved run."""
    params = init_mlp(d, args.width, args.layers)
    x = jax.random.uniform(jax.random.PRNGKey(1), (args.points, d), jnp.float32, -1.0, 1.0)
    runs, out = {}, {}
    for pair in PAIRS:
        for name, method in zip(("scaled_grad", "engine_grad"), pair):
            key = f"{name}/{method}"
            runs[key], out[key] = compiled_run(workload(name, method, d), params, x, args.inner)
    samples = timing.interleaved(runs, args.reps, warmup=1)
    for key in runs:
        out[key]["time_s"] = timing.stats(samples[key])
    ratios = {}
    for dropin_method, engine_method in PAIRS:
        dropin, engine = f"scaled_grad/{dropin_method}", f"engine_grad/{engine_method}"
        flops = out[dropin]["flops"] and out[engine]["flops"] and out[dropin]["flops"] / out[engine]["flops"]
        ratios[f"{dropin_method}/{engine_method}"] = {
            "time_dropin_over_engine": timing.paired_ratio(samples[dropin], samples[engine]),
            "flops_dropin_over_engine": round(flops, 4) if flops else None,
        }
    return {"methods": out, "ratios": ratios}


def bench(name: str, d: int, args: argparse.Namespace) -> Dict[str, Any]:
    if name == "dropin_vs_engine":
        return bench_pair(d, args)
    params = init_mlp(d, args.width, args.layers)
    x = jax.random.uniform(jax.random.PRNGKey(1), (args.points, d), jnp.float32, -1.0, 1.0)
    runs, out = {}, {}
    methods = tuple(m for m in METHODS if name != "engine_grad" or m != "taylor")
    uncollapsed = tuple(m for m in UNCOLLAPSED if m in methods)
    for method in methods:
        runs[method], out[method] = compiled_run(workload(name, method, d), params, x, args.inner)
    samples = timing.interleaved(runs, args.reps, warmup=1)
    for method in methods:
        out[method]["time_s"] = timing.stats(samples[method])
    best = min(uncollapsed, key=lambda m: out[m]["time_s"]["median"])
    best_flops = min(uncollapsed, key=lambda m: out[m]["flops"] or float("inf"))
    ratios = {
        "best_uncollapsed_by_time": best,
        "time_collapsed_over_best": timing.paired_ratio(samples["collapsed"], samples[best]),
        "time_collapsed_over": {m: round(timing.paired_ratio(samples["collapsed"], samples[m])["median"], 4)
                                for m in uncollapsed},
        "best_uncollapsed_by_flops": best_flops,
    }
    if out["collapsed"]["flops"] and out[best_flops]["flops"]:
        ratios["flops_collapsed_over_best"] = round(out["collapsed"]["flops"] / out[best_flops]["flops"], 4)
        ratios["flops_collapsed_over"] = {m: round(out["collapsed"]["flops"] / out[m]["flops"], 4) for m in uncollapsed}
    return {"methods": out, "ratios": ratios}


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[2, 3, 8])
    p.add_argument("--points", type=int, default=2000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=15, help="interleaved rounds (medians over them)")
    p.add_argument("--inner", type=int, default=3, help="calls per timed sample")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for name in ("points", "width", "layers", "reps", "inner"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    if any(d < 1 for d in args.dims):
        p.error(f"--dims={args.dims} must all be >= 1")
    record: Dict[str, Any] = {
        "benchmark": "laplacian",
        "info": timing.device_info(),
        "config": {"model": f"plain MLP {args.layers}x{args.width} tanh, float32", "points": args.points,
                   "dims": args.dims, "reps": args.reps, "inner": args.inner, "scales": SCALES,
                   "methods": list(METHODS), "workloads": args.workloads},
        "results": {},
    }
    for name in args.workloads:
        record["results"][name] = {}
        for d in args.dims:
            res = bench(name, d, args)
            record["results"][name][str(d)] = res
            r, m = res["ratios"], res["methods"]
            if name == "dropin_vs_engine":
                pairs = "  ".join(f"{k} {v['time_dropin_over_engine']['median']:.3f} "
                                  f"(flops {v['flops_dropin_over_engine']})"
                                  for k, v in r.items())
                print(f"{name} d={d}: drop-in/engine {pairs}", flush=True)
                continue
            times = "  ".join(f"{k} {1e3 * v['time_s']['median']:.2f}ms" for k, v in m.items())
            print(f"{name:13s} d={d}: {times}  | collapsed/{r['best_uncollapsed_by_time']} time "
                  f"{r['time_collapsed_over_best']['median']:.3f}, flops/{r['best_uncollapsed_by_flops']} "
                  f"{r.get('flops_collapsed_over_best')}", flush=True)
    timing.save(record, args.out)
    return record


if __name__ == "__main__":
    main()
