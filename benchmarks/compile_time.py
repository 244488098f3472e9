"""Compile time (trace + lower + compile) of the cavity (LDC) train step, fresh process each.

    python -m benchmarks.compile_time [--size 4,128,1000,200,200] [--mode fp16_scaled_order]

To compare two commits, run it in a worktree of each (``git worktree add /tmp/old REV``;
``cd /tmp/old && python -m benchmarks.compile_time``), interleaved, several times: one
measurement per process (JAX caches compiled steps within a process).
"""

import argparse
import json
import time

import jax

from benchmarks import ldc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4,128,1000,200,200", help="nr_layers,layer_size,n_interior,n_lid,n_noslip")
    ap.add_argument("--mode", default="fp16_scaled_order", choices=ldc.MODES)
    args = ap.parse_args(argv)
    size = ldc.LDCSize(*[int(v) for v in args.size.split(",")])
    s = ldc.build_step(args.mode, size)
    t = time.perf_counter()
    with s.precision():
        jax.jit(s.step).lower(s.state, s.batch).compile()
    out = {"mode": args.mode, "size": size.label, "compile_s": time.perf_counter() - t, "jax": jax.__version__}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
