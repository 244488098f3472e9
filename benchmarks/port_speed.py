"""examples/jax_user's ports, step by step: the compiled train step and loss-weight update of
each variant, timed interleaved in one process (the ports' code unchanged).

    python -m benchmarks.port_speed [--reps 15] [--out FILE.json]

Variants: ``fp32`` (fp32.py: nested ``jax.grad``, float32, matmul precision "highest"),
``fp16_plain`` (fp16.py ``--plain-fp16``: no derivative scaling), ``fp16`` (fp16.py: the
DerivScaler, ``jaxamp.grad`` choosing its method) and ``fp16_reverse`` (fp16.py with every
``jaxamp.grad`` call given ``method="reverse"``: nested reverse mode, what the drop-in computed
before it chose methods).
Each port runs ``--warm-steps`` steps (tracing, compiling, the profile start); the jitted
``train_step`` and ``update_weights`` (``jax.jacrev`` of the per-term losses over the params,
the gradient-norm loss weights) are captured with their last arguments and timed on them.
The ports' own batch (256 interior points). The record names the machine and versions; median
ms, paired ratios to ``fp16`` and the kernels (fusions and dots) each compiled program runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
from typing import Any, Dict

import jax

import jaxamp
from benchmarks import timing

WANTED = ("train_step", "update_weights")


@contextlib.contextmanager
def capture(store: Dict[str, Any]):
    """Inside: ``jax.jit`` of the functions named in WANTED keeps ``(jitted, last args)`` in ``store``."""
    jit = jax.jit

    def capturing(fun=None, **kw):
        jitted = jit(fun, **kw)
        name = getattr(fun, "__name__", "")
        if name not in WANTED:
            return jitted

        def call(*args):
            store[name] = (jitted, args)
            return jitted(*args)

        return call

    jax.jit = capturing
    try:
        yield
    finally:
        jax.jit = jit


def kernels(jitted, args, variant: str) -> int:
    """Fusions and library calls (dot, custom-call, convolution) in the compiled entry computation."""
    precision = "highest" if variant == "fp32" else None  # the program fp32.py traced
    with jax.default_matmul_precision(precision):
        text = jitted.lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    return len(re.findall(r"= \S+ (?:fusion|dot|custom-call|convolution)\(", entry))


def run_port(variant: str, warm: int) -> Dict[str, Any]:
    from examples.jax_user import fp16, fp32

    store: Dict[str, Any] = {}
    argv = ["--steps", str(warm), "--domain-scale", "0.02"]
    grad = jaxamp.grad
    if variant == "fp16_reverse":  # the port calls jaxamp.grad inside main: every call in reverse mode
        jaxamp.grad = functools.partial(grad, method="reverse")
    try:
        with capture(store):
            if variant == "fp32":
                with jax.default_matmul_precision("highest"):
                    fp32.main(argv)
            else:
                fp16.main(argv + (["--plain-fp16"] if variant == "fp16_plain" else []))
    finally:
        jaxamp.grad = grad
    return store


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--warm-steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("reps", "inner", "warm_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    record: Dict[str, Any] = {"benchmark": "port_speed", "info": timing.device_info(), "config": vars(args),
                              "results": {}}
    variants = ("fp32", "fp16_plain", "fp16", "fp16_reverse")
    captured = {v: run_port(v, args.warm_steps) for v in variants}
    for fn in WANTED:
        runs = {v: timing.timer(lambda c=captured[v][fn]: c[0](*c[1]), args.inner) for v in variants}
        samples = timing.interleaved(runs, args.reps, warmup=1)
        out = {"ms": {v: round(1e3 * timing.stats(samples[v])["median"], 3) for v in variants},
               "over_fp16": {v: round(timing.paired_ratio(samples[v], samples["fp16"])["median"], 4)
                             for v in variants if v != "fp16"},
               "kernels": {v: kernels(*captured[v][fn], v) for v in variants}}
        record["results"][fn] = out
        print(f"{fn}: " + "  ".join(f"{v} {ms:.2f}ms" for v, ms in out["ms"].items())
              + "  | over fp16: " + json.dumps(out["over_fp16"]), flush=True)
    timing.save(record, args.out)
    return record


if __name__ == "__main__":
    main()
