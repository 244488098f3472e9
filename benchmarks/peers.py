"""The Laplacian against its peers: folx, ``jnp.trace(jax.hessian)`` and ``jaxamp.laplacian``.

    python -m benchmarks peers [--dims 2 8 32 100] [--shapes 4x64 3x128] [--out FILE]

A tanh MLP (``LAYERSxWIDTH``, float32) at ``--points`` points (``vmap``); per (shape, d, method)
two workloads: ``value`` (the float32 Laplacian at every point) and ``step`` (``value_and_grad``
over the parameters of ``mean(lap**2)``); ``fp16_step``: for jaxamp the float16 user step
(``jaxamp.autocast`` / ``jaxamp.init`` / ``jaxamp.value_and_grad``), for folx its Laplacian of
the same ``jaxamp.autocast`` network under plain ``jax.value_and_grad`` (float16 with no loss
scale and no overflow check: the least a float16 folx step does). Reported: medians of
interleaved rounds, XLA FLOPs (compiled cost analysis), trace + compile seconds, XLA buffer
sizes, and jaxamp / folx ratios. folx is a benchmark extra (``pip install folx``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any, Callable, Dict

import jax
import jax.numpy as jnp

import jaxamp
from benchmarks import timing
from benchmarks.laplacian import init_mlp, mlp

try:
    import folx
except ImportError:  # a benchmark extra, not a dependency of jaxamp
    folx = None

METHODS = ("folx", "hessian", "jaxamp")


def lap_fn(method: str) -> Callable:
    """``lap(params, x)`` for one point ``x`` of shape (d,)."""
    if method == "folx":
        return lambda p, x: folx.forward_laplacian(lambda z: mlp(p, z))(x).laplacian
    if method == "hessian":
        return lambda p, x: jnp.trace(jax.hessian(mlp, 1)(p, x))
    return jaxamp.laplacian(mlp, 1)


def value_fn(method: str) -> Callable:
    return jax.vmap(lap_fn(method), (None, 0))


def step_fn(method: str) -> Callable:
    lap = value_fn(method)
    return jax.value_and_grad(lambda p, x: jnp.mean(lap(p, x) ** 2))


AMP16 = jaxamp.AmpConfig(dtype="float16")
mlp16 = jaxamp.autocast(mlp, AMP16)  # the float16 network of both float16 steps


def fp16_step(params: Any, x: jax.Array):
    """The float16 user step and its arguments ``(state, params, x)``."""
    lap = jax.vmap(jaxamp.laplacian(mlp16, 1), (None, 0))
    loss = lambda p, z: jnp.mean(lap(p, z) ** 2)  # noqa: E731
    state = jaxamp.init(loss, AMP16)(params, x)
    return jaxamp.value_and_grad(loss), (state, params, x)


def folx_fp16_step(params: Any, x: jax.Array):
    """folx's float16 step on the same network and its arguments ``(params, x)``."""
    lap = jax.vmap(lambda p, z: folx.forward_laplacian(lambda q: mlp16(p, q))(z).laplacian, (None, 0))
    return jax.value_and_grad(lambda p, z: jnp.mean(lap(p, z) ** 2)), (params, x)


def compiled_run(fn: Callable, args: tuple, inner: int):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    record = {"trace_compile_s": round(time.perf_counter() - start, 3), **timing.cost_of(compiled),
              **timing.memory_of(compiled)}
    return timing.timer(lambda: compiled(*args), inner), record


def check_agree(params: Any, x: jax.Array) -> float:
    """Largest relative difference of the three float32 Laplacians."""
    vals = {m: jax.jit(value_fn(m))(params, x) for m in METHODS}
    ref = vals["hessian"]
    scale = float(jnp.max(jnp.abs(ref))) + 1e-30
    return max(float(jnp.max(jnp.abs(vals[m] - ref))) / scale for m in METHODS)


def bench(layers: int, width: int, d: int, args: argparse.Namespace) -> Dict[str, Any]:
    points = args.points if d < 1000 else args.points_large
    params = init_mlp(d, width, layers)
    x = jax.random.uniform(jax.random.PRNGKey(1), (points, d), jnp.float32, -1.0, 1.0)
    runs, out = {}, {}
    for m in METHODS:
        runs[f"value/{m}"], out[f"value/{m}"] = compiled_run(value_fn(m), (params, x), args.inner)
        runs[f"step/{m}"], out[f"step/{m}"] = compiled_run(step_fn(m), (params, x), args.inner)
    for name, build in (("fp16_step/jaxamp", fp16_step), ("fp16_step/folx", folx_fp16_step)):
        try:
            fn, fargs = build(params, x)
            runs[name], out[name] = compiled_run(fn, fargs, args.inner)
        except Exception as e:  # recorded, not fatal: the float32 columns still stand
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    res: Dict[str, Any] = {"points": points, "max_rel_diff_vs_hessian": check_agree(params, x)}
    if not args.no_time:
        samples = timing.interleaved(runs, args.reps, warmup=1)
        for k in runs:
            out[k]["time_s"] = timing.stats(samples[k])
    ratios = {}
    pairs = (("value", "value/jaxamp", "value/folx"), ("step", "step/jaxamp", "step/folx"),
             ("fp16_step", "fp16_step/jaxamp", "step/folx"),
             ("fp16_step_vs_fp16", "fp16_step/jaxamp", "fp16_step/folx"))
    for work, key, bkey in pairs:
        a, b = out.get(key, {}), out.get(bkey, {})
        if "error" in a or "error" in b:
            continue
        r = {"flops": a["flops"] / b["flops"] if a["flops"] and b["flops"] else None,
             "trace_compile": a["trace_compile_s"] / b["trace_compile_s"],
             "temp_bytes": a["temp_bytes"] / b["temp_bytes"] if a["temp_bytes"] and b["temp_bytes"] else None}
        if not args.no_time:
            r["time"] = timing.paired_ratio(samples[key], samples[bkey])["median"]
        ratios[f"{work}_jaxamp_over_folx"] = {k: (round(v, 4) if v is not None else None) for k, v in r.items()}
    res.update(methods=out, ratios=ratios)
    return res


def main(argv=None) -> Dict[str, Any]:
    if folx is None:
        sys.exit("benchmarks.peers needs folx, a benchmark extra: pip install folx  (or pip install -e .[benchmarks])")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[2, 8, 32, 100])
    p.add_argument("--shapes", nargs="+", default=["4x64", "3x128"])
    p.add_argument("--points", type=int, default=1000)
    p.add_argument("--points-large", type=int, default=100, help="points at d >= 1000")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--inner", type=int, default=2)
    p.add_argument("--no-time", action="store_true", help="FLOPs, compile and memory only")
    p.add_argument("--out", default=f"benchmarks/results/peers-{datetime.date.today()}.json")
    args = p.parse_args(argv)
    import importlib.metadata as md

    record: Dict[str, Any] = {"benchmark": "peers", "info": {**timing.device_info(), "folx": md.version("folx")},
                              "config": vars(args), "results": {}}
    for shape in args.shapes:
        layers, width = (int(s) for s in shape.split("x"))
        for d in args.dims:
            res = bench(layers, width, d, args)
            record["results"][f"{shape}/d={d}"] = res
            print(f"{shape} d={d}: agree {res['max_rel_diff_vs_hessian']:.1e}  "
                  + "  ".join(f"{k} {v}" for k, v in res["ratios"].items()), flush=True)
            timing.save(record, args.out)
    return record


if __name__ == "__main__":
    main()
