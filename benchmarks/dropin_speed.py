"""The drop-in's speed against the engine's and the user's own nested ``jax.grad``.

    python -m benchmarks.dropin_speed --out benchmarks/results/dropin-speed.json [--quick] [--problems ...]

Problems (Flax MLP 4x64 tanh under ``jaxamp.autocast``, default fp16 placement, ``vmap`` over
the points, ``value_and_grad`` over the parameters of a mean squared residual):

- ``burgers_k{1..4}``: scalar ``u(params, t, x)``, residual ``u_t + u u_x - nu d^k u/dx^k``;
- ``poisson2d``: ``u(params, x, y)``, residual ``u_xx + u_yy - f``;
- ``ns2d``: three outputs ``(u, v, p)(params, x, y)``, a steady Navier-Stokes momentum residual
  (first and pure second derivatives of u, v; first of p);
- ``ntk_burgers_k2``: ``jacrev`` over the parameters of the per-term losses (gradient-norm loss
  weights), fp32 / plain fp16 / fp16 + DerivScaler, reverse and auto (ratios to plain fp16).

Variants: ``fp32`` (nested ``jax.grad``), ``fp16_reverse`` (nested ``jaxamp.grad(method=
"reverse")`` under ``jaxamp.scaled``), ``fp16_auto`` (the default ``jaxamp.grad``), ``engine``
(``jaxamp.Derivatives``, same network and derivatives). Timed interleaved in one run; ratios
are paired per round; XLA FLOPs, compile time and buffer sizes (temp, arguments, outputs) from
the compiled step.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxamp
from benchmarks.timing import cost_of, device_info, interleaved, memory_of, paired_ratio, stats, timer

NU = 0.01


class MLP(nn.Module):
    outputs: int = 1

    @nn.compact
    def __call__(self, z):
        h = z
        for _ in range(4):
            h = jnp.tanh(nn.Dense(64)(h))
        return nn.Dense(self.outputs)(h)


def _nest(f, argnum, k, method, jax_grad):
    for _ in range(k):
        f = jax.grad(f, argnum) if jax_grad else jaxamp.grad(f, argnum, method=method)
    return f


def problem(name: str, variant: str, n: int):
    """``(loss(params, pts), params, pts)`` of one problem and variant."""
    amp = {"fp32": jaxamp.AmpConfig(enabled=False), "fp16_plain": jaxamp.AmpConfig(derivative_scaling=False)}.get(
        variant, jaxamp.AmpConfig())
    outs = 3 if name == "ns2d" else 1
    model = MLP(outs)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))
    key = jax.random.PRNGKey(1)
    pts = jax.random.uniform(key, (n, 2), minval=-1.0, maxval=1.0)
    net = jaxamp.autocast(model.apply, amp)
    g = dict(method="reverse" if variant == "fp16_reverse" else "auto", jax_grad=variant == "fp32")
    comps = [lambda p, a, b, i=i: net(p, jnp.stack([a, b]))[i] for i in range(outs)]
    if variant == "engine":
        return _engine_problem(name, model, amp, params, pts)
    if name.startswith("burgers") or name.startswith("ntk"):
        k = int(name[-1])
        u = comps[0]

        def r(p, t, x):
            return (u(p, t, x) * _nest(u, 2, 1, **g)(p, t, x) + _nest(u, 1, 1, **g)(p, t, x)
                    - NU * _nest(u, 2, k, **g)(p, t, x))
    elif name == "poisson2d":
        u = comps[0]

        def r(p, x, y):
            return _nest(u, 1, 2, **g)(p, x, y) + _nest(u, 2, 2, **g)(p, x, y) - jnp.sin(x) * jnp.sin(y)
    else:
        u, v, q = comps

        def r(p, x, y):
            mom = []
            for w in (u, v):
                lap = _nest(w, 1, 2, **g)(p, x, y) + _nest(w, 2, 2, **g)(p, x, y)
                adv = u(p, x, y) * _nest(w, 1, 1, **g)(p, x, y) + v(p, x, y) * _nest(w, 2, 1, **g)(p, x, y)
                mom.append(adv - NU * lap)
            return mom[0] + _nest(q, 1, 1, **g)(p, x, y) + mom[1] + _nest(q, 2, 1, **g)(p, x, y)

    def residuals(p, pts):
        return jax.vmap(r, (None, 0, 0))(p, pts[:, 0], pts[:, 1])

    return residuals, params, pts, amp


def _engine_problem(name, model, amp, params, pts):
    fn = jaxamp.autocast(model.apply, amp)
    if name.startswith("burgers") or name.startswith("ntk"):
        k = int(name[-1])
        top = "u" + "__x" * k
        eng = jaxamp.Derivatives(fn, inputs=("t", "x"), outputs=("u",), derivatives=("u__t", "u__x", top), amp=amp)

        def residuals(p, pts, scales):
            d, found = jaxamp.scaled(eng)(scales, p, pts)
            return d["u"] * d["u__x"] + d["u__t"] - NU * d[top], found
    elif name == "poisson2d":
        eng = jaxamp.Derivatives(fn, inputs=("x", "y"), outputs=("u",), derivatives=("u__x__x", "u__y__y"), amp=amp)

        def residuals(p, pts, scales):
            d, found = jaxamp.scaled(eng)(scales, p, pts)
            return d["u__x__x"] + d["u__y__y"] - jnp.sin(pts[:, 0]) * jnp.sin(pts[:, 1]), found
    else:
        names = [f"{w}__{a}" for w in "uv" for a in ("x", "y", "x__x", "y__y")] + ["p__x", "p__y"]
        eng = jaxamp.Derivatives(fn, inputs=("x", "y"), outputs=("u", "v", "p"), derivatives=names, amp=amp)

        def residuals(p, pts, scales):
            d, found = jaxamp.scaled(eng)(scales, p, pts)
            mom = [d["u"] * d[f"{w}__x"] + d["v"] * d[f"{w}__y"] - NU * (d[f"{w}__x__x"] + d[f"{w}__y__y"])
                   for w in "uv"]
            return mom[0] + d["p__x"] + mom[1] + d["p__y"], found

    scales = {k: jnp.float32(1.0) for k in eng.scaler_keys}
    return residuals, params, pts, amp, scales


def step_fn(name: str, variant: str, n: int) -> Callable[[], Any]:
    """A jitted step (value and weight gradient, or jacrev for ntk) and its arguments."""
    built = problem(name, variant, n)
    if variant == "engine":
        residuals, params, pts, amp, scales = built

        def loss(p):
            r, found = residuals(p, pts, scales)
            return jnp.mean(r**2), found

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        return step, (params,)
    residuals, params, pts, amp = built
    if name.startswith("ntk"):
        def losses(p, pts):
            r = residuals(p, pts)
            return {"res": jnp.mean(r**2), "mean": jnp.mean(r)}

        fun = jax.jacrev(losses)
    else:
        def loss(p, pts):
            return jnp.mean(residuals(p, pts) ** 2)

        if variant != "fp32":  # the user's step: jaxamp.value_and_grad
            state = jaxamp.init(loss, amp, from_profile=False)(params, pts)
            vg = jaxamp.value_and_grad(loss)
            return jax.jit(lambda p, pts: vg(state, p, pts)), (params, pts)
        fun = jax.value_and_grad(loss)
    if variant != "fp32":
        state = jaxamp.init(fun, amp, from_profile=False)(params, pts)
        scaled = jaxamp.scaled(fun)
        return jax.jit(lambda p, pts: scaled(state, p, pts)), (params, pts)
    return jax.jit(fun), (params, pts)


PROBLEMS = ("burgers_k1", "burgers_k2", "burgers_k3", "burgers_k4", "poisson2d", "ns2d")


def bench(name: str, variants, n: int, reps: int) -> Dict[str, Any]:
    fns, out = {}, {"problem": name, "points": n, "variants": {}}
    for v in variants:
        step, args = step_fn(name, v, n)
        t0 = time.perf_counter()
        compiled = step.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(compiled(*args))
        fns[v] = timer(lambda c=compiled, a=args: c(*a), inner=2)
        out["variants"][v] = {"compile_s": compile_s, **cost_of(compiled), **memory_of(compiled)}
    times = interleaved(fns, reps)
    for v in variants:
        out["variants"][v]["time"] = stats(times[v])
    base = "engine" if "engine" in variants else "fp16_plain"
    out["ratios"] = {f"{v}/{base}": paired_ratio(times[v], times[base]) for v in variants if v != base}
    print(name, {k: round(r["median"], 3) for k, r in out["ratios"].items()},
          {v: round(1e3 * out["variants"][v]["time"]["median"], 2) for v in variants}, flush=True)
    return out


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="100 points, 2 reps, two problems (smoke)")
    ap.add_argument("--problems", nargs="+", default=None, choices=PROBLEMS + ("ntk_burgers_k2",),
                    help="a subset of the problems (default: all; --quick: two)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("points", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)} must be >= 1")
    n, reps = (100, 2) if args.quick else (args.points, args.reps)
    problems = PROBLEMS[1:2] + ("ntk_burgers_k2",) if args.quick else PROBLEMS + ("ntk_burgers_k2",)
    problems = tuple(args.problems) if args.problems else problems
    result = {"device": device_info(), "jax": jax.__version__, "rows": []}
    for name in problems:
        variants = ("fp32", "fp16_plain", "fp16_reverse", "fp16_auto") if name.startswith("ntk") else (
            "fp32", "fp16_reverse", "fp16_auto", "engine")
        result["rows"].append(bench(name, variants, n, reps))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
