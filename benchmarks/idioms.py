"""The drop-in's idioms against the engine: the same residual written every way a user writes it.

    python -m benchmarks idioms [--problems burgers_k2 ns2d] [--points 2000] [--no-time] [--out FILE]

The problems, network and step of :mod:`benchmarks.dropin_speed` (fp16 + DerivScaler, the user's
``jaxamp.value_and_grad`` step; the engine: ``jaxamp.Derivatives``). Idioms:

- ``nested``: ``jaxamp.grad(jaxamp.grad(u, 2), 2)`` with int ``argnums`` (scalar inputs);
- ``tuple``: first derivatives by ``jaxamp.grad(u, argnums=(1, 2))``, higher ones nested;
- ``jacfwd`` / ``jacrev``: ``u(params, z)`` of a vector ``z = [a, b]``: first derivatives by
  ``jaxamp.jacfwd`` / ``jaxamp.jacrev``, second by ``jaxamp.hessian`` (first and second order
  problems only);
- ``has_aux``: first derivatives and the value together, ``jaxamp.grad(lambda *a: (u(*a), u(*a)),
  argnum, has_aux=True)``; higher ones nested.

Reported per (problem, idiom): XLA FLOPs, trace + compile seconds, and (unless ``--no-time``)
the median step time of interleaved rounds, each as a ratio to the engine's. ``jacfwd`` /
``jacrev`` / ``hessian`` along the 2-entry ``z`` are planned entry by entry (their unread
entries dropped); ``engine_full`` is the engine computing every entry (every first and second
derivative of every output), what JAX's vector form computes (``over_engine_full``); ``jax_nested`` and
``jax_jacfwd`` are the plain float32 JAX steps written both ways (``jax_jacfwd_over_jax_nested``:
what the vector idiom costs in JAX itself).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from typing import Any, Callable, Dict

import jax
import jax.numpy as jnp

import jaxamp
from benchmarks import dropin_speed as ds
from benchmarks.timing import cost_of, device_info, interleaved, paired_ratio, stats, timer

IDIOMS = ("nested", "tuple", "jacfwd", "jacrev", "has_aux")
PROBLEMS = ("burgers_k1", "burgers_k2", "burgers_k3", "burgers_k4", "poisson2d", "ns2d")


def _vector(name: str, idiom: str, comps, lib: Any = jaxamp) -> Callable:
    """The residual ``r(p, a, b)`` with derivatives along the vector ``z = [a, b]`` (``lib``:
    jaxamp's derivatives, or ``jax``'s own)."""
    jac = lib.jacfwd if idiom == "jacfwd" else lib.jacrev

    def r(p, a, b):
        z = jnp.stack([a, b])
        if name == "poisson2d":
            h = lib.hessian(comps[0], 1)(p, z)
            return h[0, 0] + h[1, 1] - jnp.sin(a) * jnp.sin(b)
        if name.startswith("burgers"):
            u = comps[0]
            g = jac(u, 1)(p, z)
            top = g[1] if name == "burgers_k1" else lib.hessian(u, 1)(p, z)[1, 1]
            return u(p, z) * g[1] + g[0] - ds.NU * top
        u, v, q = comps
        mom = []
        for w in (u, v):
            g, h = jac(w, 1)(p, z), lib.hessian(w, 1)(p, z)
            mom.append(u(p, z) * g[0] + v(p, z) * g[1] - ds.NU * (h[0, 0] + h[1, 1]))
        gq = jac(q, 1)(p, z)
        return mom[0] + gq[0] + mom[1] + gq[1]

    return r


def _scalar(name: str, idiom: str, comps, lib: Any = jaxamp) -> Callable:
    """The residual ``r(p, a, b)`` with derivatives along the scalars ``a``, ``b``."""
    def nest(f, n, k):
        for _ in range(k):
            f = lib.grad(f, n)
        return f

    def first(f, p, a, b):
        if idiom == "tuple":
            return jaxamp.grad(f, (1, 2))(p, a, b)
        if idiom == "has_aux":  # each first derivative with the value (the aux) beside it
            with_value = lambda *y: (f(*y), f(*y))  # noqa: E731
            return tuple(jaxamp.grad(with_value, n, has_aux=True)(p, a, b)[0] for n in (1, 2))
        return lib.grad(f, 1)(p, a, b), lib.grad(f, 2)(p, a, b)

    def r(p, a, b):
        if name.startswith("burgers"):
            u = comps[0]
            ut, ux = first(u, p, a, b)
            return u(p, a, b) * ux + ut - ds.NU * nest(u, 2, int(name[-1]))(p, a, b)
        if name == "poisson2d":
            u = comps[0]
            return nest(u, 1, 2)(p, a, b) + nest(u, 2, 2)(p, a, b) - jnp.sin(a) * jnp.sin(b)
        u, v, q = comps
        mom = []
        for w in (u, v):
            wx, wy = first(w, p, a, b)
            mom.append(u(p, a, b) * wx + v(p, a, b) * wy - ds.NU * (nest(w, 1, 2)(p, a, b) + nest(w, 2, 2)(p, a, b)))
        qx, qy = first(q, p, a, b)
        return mom[0] + qx + mom[1] + qy

    return r


def applies(name: str, idiom: str) -> bool:
    if idiom in ("jacfwd", "jacrev"):
        return name in ("burgers_k1", "burgers_k2", "poisson2d", "ns2d")
    return not (idiom == "has_aux" and name == "poisson2d")  # no first derivatives there


def _engine_full(name: str, n: int):
    """The engine's step computing every first and second derivative of every output."""
    amp = jaxamp.AmpConfig()
    outputs = ("u", "v", "p") if name == "ns2d" else ("u",)
    model = ds.MLP(len(outputs))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))
    pts = jax.random.uniform(jax.random.PRNGKey(1), (n, 2), minval=-1.0, maxval=1.0)
    names = [f"{w}__{a}" for w in outputs for a in ("a", "b", "a__a", "a__b", "b__b")]
    eng = jaxamp.Derivatives(jaxamp.autocast(model.apply, amp), inputs=("a", "b"), outputs=outputs,
                             derivatives=names, amp=amp)
    scales = {k: jnp.float32(1.0) for k in eng.scaler_keys}

    def loss(p):
        d, found = jaxamp.scaled(eng)(scales, p, pts)
        return jnp.mean(sum(d[k] for k in names) ** 2), found

    return jax.jit(jax.value_and_grad(loss, has_aux=True)), (params,)


def step_fn(name: str, idiom: str, n: int):
    """A jitted fp16 user step of ``name`` written with ``idiom`` (``"engine"``: the engine's;
    ``"engine_full"``: the engine computing every first and second derivative; ``"jax_nested"``
    / ``"jax_jacfwd"``: plain JAX in float32, nested ``jax.grad`` / ``jax.jacfwd`` + ``jax.hessian``)."""
    if idiom == "engine":
        return ds.step_fn(name, "engine", n)
    if idiom == "engine_full":
        return _engine_full(name, n)
    jax_own = idiom.startswith("jax_")
    amp = jaxamp.AmpConfig(enabled=not jax_own)
    outs = 3 if name == "ns2d" else 1
    model = ds.MLP(outs)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))
    pts = jax.random.uniform(jax.random.PRNGKey(1), (n, 2), minval=-1.0, maxval=1.0)
    net = model.apply if jax_own else jaxamp.autocast(model.apply, amp)
    lib = jax if jax_own else jaxamp
    if idiom in ("jacfwd", "jacrev", "jax_jacfwd"):
        r = _vector(name, idiom.removeprefix("jax_"), [lambda p, z, i=i: net(p, z)[i] for i in range(outs)], lib)
    else:
        r = _scalar(name, idiom, [lambda p, a, b, i=i: net(p, jnp.stack([a, b]))[i] for i in range(outs)], lib)

    def loss(p, pts):
        return jnp.mean(jax.vmap(r, (None, 0, 0))(p, pts[:, 0], pts[:, 1]) ** 2)

    if jax_own:
        return jax.jit(jax.value_and_grad(loss)), (params, pts)
    state = jaxamp.init(loss, amp, from_profile=False)(params, pts)
    vg = jaxamp.value_and_grad(loss)
    return jax.jit(lambda p, pts: vg(state, p, pts)), (params, pts)


def bench(name: str, n: int, reps: int, timed: bool) -> Dict[str, Any]:
    idioms = ("engine",) + tuple(i for i in IDIOMS if applies(name, i))
    if applies(name, "jacfwd"):  # and JAX's own float32 step, nested and vector, for their ratio
        idioms += ("engine_full", "jax_nested", "jax_jacfwd")
    row: Dict[str, Any] = {"problem": name, "points": n, "idioms": {}}
    fns = {}
    for idiom in idioms:
        step, args = step_fn(name, idiom, n)
        start = time.perf_counter()
        compiled = step.lower(*args).compile()
        row["idioms"][idiom] = {"trace_compile_s": round(time.perf_counter() - start, 3), **cost_of(compiled)}
        if timed:
            jax.block_until_ready(compiled(*args))
            fns[idiom] = timer(lambda c=compiled, a=args: c(*a), inner=2)
    eng = row["idioms"]["engine"]
    row["over_engine"] = {i: {"flops": round(row["idioms"][i]["flops"] / eng["flops"], 4),
                              "trace_compile": round(row["idioms"][i]["trace_compile_s"] / eng["trace_compile_s"], 3)}
                          for i in idioms if i != "engine"}
    if "engine_full" in idioms:
        full = row["idioms"]["engine_full"]["flops"]
        row["over_engine_full"] = {i: {"flops": round(row["idioms"][i]["flops"] / full, 4)}
                                   for i in ("jacfwd", "jacrev")}
        jax_nested = row["idioms"]["jax_nested"]["flops"]
        row["jax_jacfwd_over_jax_nested"] = {"flops": round(row["idioms"]["jax_jacfwd"]["flops"] / jax_nested, 4)}
    if timed:
        times = interleaved(fns, reps)
        for i in idioms:
            row["idioms"][i]["time"] = stats(times[i])
            if i != "engine":
                row["over_engine"][i]["time"] = round(paired_ratio(times[i], times["engine"])["median"], 3)
        if "jax_jacfwd" in idioms:
            ratio = paired_ratio(times["jax_jacfwd"], times["jax_nested"])["median"]
            row["jax_jacfwd_over_jax_nested"]["time"] = round(ratio, 3)
    print(name, row["over_engine"], row.get("over_engine_full", ""), row.get("jax_jacfwd_over_jax_nested", ""),
          flush=True)
    return row


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", nargs="+", choices=PROBLEMS, default=list(PROBLEMS))
    ap.add_argument("--points", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-time", action="store_true", help="FLOPs and compile only")
    ap.add_argument("--out", default=f"benchmarks/results/idioms-{datetime.date.today()}.json")
    args = ap.parse_args(argv)
    for key in ("points", "reps"):
        if getattr(args, key) < 1:
            ap.error(f"--{key}={getattr(args, key)} must be >= 1")
    result = {"benchmark": "idioms", "info": device_info(), "config": vars(args),
              "rows": [bench(p, args.points, args.reps, not args.no_time) for p in args.problems]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
