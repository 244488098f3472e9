"""examples/jax_user's fp16 port: training time with the default jaxamp.grad (engine plans) and
with nested reverse mode forced (the port's code unchanged; chain plans switched off).

    python -m benchmarks.port_speed [--steps 300] [--rounds 2]

Each round runs both, alternating (interleaved); one process, so the second run of each
variant reuses nothing compiled (the steps are rebuilt by main()).
"""

import argparse
import json
import time

import jax

from jaxamp.dropin import chain


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    from examples.jax_user import fp16

    eligible, out = chain.eligible, {"auto": [], "reverse": []}
    for _ in range(args.rounds):
        for variant in ("auto", "reverse"):
            chain.eligible = eligible if variant == "auto" else (lambda *a: False)
            try:
                t = time.perf_counter()
                res = fp16.main(["--steps", str(args.steps), "--domain-scale", "0.02"])
                out[variant].append({"s": time.perf_counter() - t, "error": res["error"]})
            finally:
                chain.eligible = eligible
    print(json.dumps({"jax": jax.__version__, "steps": args.steps, **out}))
    return out


if __name__ == "__main__":
    main()
