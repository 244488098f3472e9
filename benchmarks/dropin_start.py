"""What starting the drop-in port from its profile costs: examples/jax_user/fp16.py, timed.

Runs the port (``--domain-scale 0.02`` by default) with ``jaxamp.init`` wrapped to time it
(trace, profile, compile and run, once, with its result fetched), and the whole run; writes one
JSON record.

    python -m benchmarks.dropin_start --steps 1500 --out benchmarks/results/dropin-start.json
"""

import argparse
import json
import platform
import time

import jax

from examples.jax_user import fp16
import jaxamp


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--domain-scale", type=float, default=0.02)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record, original = {}, jaxamp.init

    def timed(fun, amp=None, **options):
        init = original(fun, amp, **options)

        def run(*a, **kw):
            start = time.perf_counter()
            state = jax.block_until_ready(init(*a, **kw))
            record["init_s"] = time.perf_counter() - start
            record["start_scales_log2"] = {k: float(jax.numpy.log2(v)) for k, v in state.scales.items()}
            return state

        return run

    jaxamp.init = timed  # the port calls jaxamp.init once
    try:
        start = time.perf_counter()
        result = fp16.main(["--steps", str(args.steps), "--domain-scale", str(args.domain_scale)])
        record["run_s"] = time.perf_counter() - start
    finally:
        jaxamp.init = original
    record.update(result, steps=args.steps, domain_scale=args.domain_scale, jax=jax.__version__,
                  machine=platform.machine(), processor=platform.processor() or platform.platform())
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
