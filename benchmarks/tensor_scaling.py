"""Per-tensor scaling and FP8 on the plain-JAX Burgers port in physical units: fp32, fp16 +
DerivScaler, fp16 + DerivScaler + per-tensor scales, fp16 with per-tensor scales only, plain
fp16, the FP8 recipe (``dtype="float8"``: per-tensor scales, DerivScaler) and plain FP8.

    python -m benchmarks.tensor_scaling --steps 1500 --seeds 0 1 --out benchmarks/results/tensor-scaling.json

Each variant runs examples/jax_user (fp32.py, or the port fp16.py, whose every layer is float16:
``autocast_firstlayer=True``) at ``--domain-scale 0.02`` and reports its relative L2 error and
its ratio to fp32's at the same seed. The port builds its config with ``jaxamp.AmpConfig(...)``;
a variant's keys replace the port's (``with_keys``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any, Dict, Iterator

import jax

import jaxamp
from benchmarks.timing import device_info

VARIANTS: Dict[str, Dict[str, Any]] = {
    "fp32": {},
    "fp16_scaler": {},
    "fp16_scaler_tensor": {"tensor_scaling": True},
    "fp16_tensor_only": {"tensor_scaling": True},
    "fp16_plain": {},
    "fp8_recipe": {"dtype": "float8"},
    "fp8_plain": {"dtype": "float8", "tensor_scaling": False},
    # ablation: the port's first layer (Fourier features of the physical length scale) in float32
    "fp8_recipe_first_fp32": {"dtype": "float8", "autocast_firstlayer": False},
    "fp16_plain_first_fp32": {"autocast_firstlayer": False},
    # ablation per operand role: the FP8 recipe with one role's operands in float16 instead
    "fp8_recipe_tangent_fp16": {"dtype": "float8", "float8_formats": {"tangent": "float16"}},
    "fp8_recipe_cotangent_fp16": {"dtype": "float8", "float8_formats": {"cotangent": "float16"}},
}
PLAIN = ("fp16_tensor_only", "fp16_plain", "fp8_plain", "fp16_plain_first_fp32")  # the port's --plain-fp16: no derivative scaling


@contextlib.contextmanager
def with_keys(**keys: Any) -> Iterator[None]:
    """``jaxamp.AmpConfig(...)`` called by the example gets ``keys`` (over its own), for this block."""
    original = jaxamp.AmpConfig
    jaxamp.AmpConfig = lambda **given: original(**{**given, **keys})
    try:
        yield
    finally:
        jaxamp.AmpConfig = original


def run(variant: str, seed: int, steps: int) -> Dict[str, Any]:
    from examples.jax_user import fp16, fp32

    argv = ["--steps", str(steps), "--domain-scale", "0.02", "--seed", str(seed)]
    start = time.perf_counter()
    if variant == "fp32":
        with jax.default_matmul_precision("highest"):
            out = fp32.main(argv)
    else:
        with with_keys(**VARIANTS[variant]):
            out = fp16.main(argv + (["--plain-fp16"] if variant in PLAIN else []))
    return {**out, "seconds": time.perf_counter() - start}


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps={args.steps} must be >= 1")
    record: Dict[str, Any] = {"benchmark": "tensor_scaling", "info": device_info(), "config": vars(args), "runs": []}
    for seed in args.seeds:
        base = None
        for variant in args.variants:
            out = run(variant, seed, args.steps)
            base = out["error"] if variant == "fp32" else base
            row = {"seed": seed, "variant": variant, **out,
                   "over_fp32": None if base is None else out["error"] / base}  # fmt: skip
            record["runs"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
