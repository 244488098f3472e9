"""Per-tensor scaling and the FP8 recipe on PINN problems in physical units: fp32, bf16, fp16
(plain, per-order DerivScaler, + per-tensor scales), plain FP8, the FP8 recipe and the recipe
with one operand role in another format (the per-role ablation).

    python -m benchmarks.tensor_scaling --problem jax_burgers ldc_demo flax_poisson --seeds 0 1 \\
        --out benchmarks/results/tensor-scaling.json
    python -m benchmarks.tensor_scaling --tables benchmarks/results/tensor-scaling.json  # markdown

Problems (``--problem``; ``--steps`` replaces each one's default step count):

- ``jax_burgers``: examples/jax_user (the plain-JAX Burgers port, Fourier features of the
  physical length scale) at ``--domain-scale 0.02``; default 1500 steps.
- ``ldc_demo``: examples.ldc with ``examples/configs/ldc_demo.yaml`` (the CPU cavity
  demonstration: 0.05 m box, Re 10; scripts/demo.sh); default 3000 steps (the demo runs 10 000).
  Its network is built in float32 and placed by ``jaxamp.autocast`` (``--ldc-placement
  autocast``, :func:`autocast_placement`; the tables of docs/tensor_scaling.md). The demo's own
  placement, the modules' dtype fields (``--ldc-placement modules``), ran float16 whatever
  ``tensor_scaling`` and ``dtype="float8"`` said up to eda1c05 (the same bits as fp16 with the
  DerivScaler); jaxamp.models takes both since 6167fd4.
- ``flax_poisson``: examples/flax_user (Poisson on a 2 mm plate, Flax TrainState, the Laplacian
  by ``jaxamp.hessian``); default 1500 steps.

Every low-precision variant runs every layer in low precision (``autocast_firstlayer=True``)
unless its name says otherwise. The AMP keys reach each example through its own mechanism:
the cavity's ``mode=`` preset, or ``mode=custom`` with ``amp.<key>=<value>`` overrides; the user
ports' ``--plain-fp16`` flag (no derivative scaling), and, since they build
``jaxamp.AmpConfig(...)`` themselves, the variant's other keys over theirs (:func:`with_keys`).

Each run reports its relative L2 error, the ratio to fp32's at the same seed and problem, the
skipped steps and the final log2 scales (derivative scalers by key, ``loss`` the loss scale).
The cavity reports skips and scales itself; for the user ports :func:`recording_optimizer`
wraps ``jaxamp.optimizer`` and reads the optimizer state (``skip_reason``, the AmpState's
scales) after each update. ``--out`` is rewritten after every run; ``--tables`` prints the
markdown tables of one or more such files and the FP8 variants' median error over fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import jax
import numpy as np

import jaxamp
from benchmarks.timing import device_info

# AmpConfig keys of each variant, over "float16, every layer, per-order DerivScaler".
VARIANTS: Dict[str, Dict[str, Any]] = {
    "fp32": {"enabled": False},
    "bf16": {"dtype": "bfloat16", "derivative_scaling": False},
    "fp16_plain": {"derivative_scaling": False},
    "fp16_scaler": {},
    "fp16_scaler_stored": {"recompute_float32": False},  # the float32 values stored for the backward pass
    "fp16_scaler_tensor": {"tensor_scaling": True},
    "fp16_tensor_only": {"tensor_scaling": True, "derivative_scaling": False},
    "fp8_plain": {"dtype": "float8", "tensor_scaling": False, "derivative_scaling": False},
    "fp8_recipe": {"dtype": "float8"},
    # the FP8 recipe with one role's matmul operands in another format (ablation per role)
    "fp8_tangent_e5m2": {"dtype": "float8", "float8_formats": {"tangent": "float8_e5m2"}},
    "fp8_tangent_fp16": {"dtype": "float8", "float8_formats": {"tangent": "float16"}},
    "fp8_cotangent_fp16": {"dtype": "float8", "float8_formats": {"cotangent": "float16"}},
    "fp8_value_e4m3": {"dtype": "float8", "float8_formats": {"value": "float8_e4m3fn"}},
    "fp8_cotangent_e4m3": {"dtype": "float8", "float8_formats": {"cotangent": "float8_e4m3fn"}},
    # two roles changed: tangents float16 and cotangents E4M3 (per-tensor scales give them the range)
    "fp8_tangent_fp16_cotangent_e4m3": {"dtype": "float8",
                                        "float8_formats": {"tangent": "float16", "cotangent": "float8_e4m3fn"}},
    # the first layer (the one carrying the physical length scale) in float32
    "fp8_recipe_first_fp32": {"dtype": "float8", "autocast_firstlayer": False},
    "fp16_plain_first_fp32": {"derivative_scaling": False, "autocast_firstlayer": False},
}
DEFAULT_VARIANTS = (
    "fp32", "bf16", "fp16_plain", "fp16_scaler", "fp16_scaler_tensor", "fp8_plain", "fp8_recipe",
    "fp8_tangent_e5m2", "fp8_tangent_fp16", "fp8_cotangent_fp16", "fp8_value_e4m3",
)
# The cavity's named mode presets (examples/common/config.py MODES) for the variants that have one.
LDC_PRESETS = {"fp32": "fp32", "bf16": "bf16", "fp16_plain": "fp16_plain", "fp16_scaler": "fp16_scaler_per_order"}
DEFAULT_STEPS = {"jax_burgers": 1500, "ldc_demo": 3000, "flax_poisson": 1500}
ROLES = jaxamp._src.placement.tensor_scale.ROLES
# the library's recipe, recorded in each file
FP8_DEFAULT_ROLES = dict(zip(ROLES, jaxamp._src.placement.tensor_scale.FP8_FORMATS))
# The recipe of result files written before they recorded theirs (eda1c05's: E4M3 tangents, E5M2 cotangents).
FP8_UNRECORDED_ROLES = {"value": "float16", "tangent": "float8_e4m3fn", "cotangent": "float8_e5m2"}


@contextlib.contextmanager
def with_keys(**keys: Any) -> Iterator[None]:
    """``jaxamp.AmpConfig(...)`` called by the example gets ``keys`` (over its own), for this block."""
    original = jaxamp.AmpConfig
    jaxamp.AmpConfig = lambda **given: original(**{**given, **keys})
    try:
        yield
    finally:
        jaxamp.AmpConfig = original


@contextlib.contextmanager
def recording_optimizer(log: List[Dict[str, Any]]) -> Iterator[None]:
    """``jaxamp.optimizer(...)`` called by the example records, after each update, whether the
    step was skipped and the log2 scales of its state (a host callback per step) into ``log``."""
    original = jaxamp.optimizer

    def record(reason, scales, loss_scale):
        out = {k: float(np.log2(v)) for k, v in scales.items()}
        log.append({"skipped": int(reason) != 0, "scale_log2": {**out, "loss": float(np.log2(loss_scale))}})

    def wrapped(*args: Any, **kwargs: Any):
        tx = original(*args, **kwargs)

        def update(updates, state, params=None, **extra):
            new_updates, new_state = tx.update(updates, state, params, **extra)
            amp = new_state.amp
            jax.debug.callback(record, new_state.skip_reason, dict(amp.scales), amp.loss_scale)
            return new_updates, new_state

        return type(tx)(tx.init, update)

    jaxamp.optimizer = wrapped
    try:
        yield
    finally:
        jaxamp.optimizer = original


def _port_summary(log: List[Dict[str, Any]]) -> Dict[str, Any]:
    skipped = [i + 1 for i, r in enumerate(log) if r["skipped"]]
    return {
        "skipped_steps": len(skipped),
        "first_skipped_step": skipped[0] if skipped else None,
        "final_scale_log2": log[-1]["scale_log2"] if log else {},
    }


def _run_port(module: str, argv: List[str], variant: str) -> Dict[str, Any]:
    """A user port (``examples.<module>``): fp32.py, or fp16.py with the variant's keys."""
    import importlib

    keys = dict(VARIANTS[variant])
    if variant == "fp32":
        fp32 = importlib.import_module(f"examples.{module}.fp32")
        with jax.default_matmul_precision("highest"):
            out = fp32.main(argv)
        return {"error": out["error"], "skipped_steps": 0, "first_skipped_step": None, "final_scale_log2": {}}
    fp16 = importlib.import_module(f"examples.{module}.fp16")
    plain = keys.pop("derivative_scaling", True) is False
    log: List[Dict[str, Any]] = []
    with with_keys(**keys), recording_optimizer(log):
        out = fp16.main(argv + (["--plain-fp16"] if plain else []))
        jax.effects_barrier()
    return {"error": out["error"], **_port_summary(log)}


def _overrides(variant: str, steps: int, seed: int) -> List[str]:
    """The cavity's command-line overrides for a variant (``python -m examples.ldc --config ldc_demo ...``)."""
    from examples.common.config import MODES

    out = [f"seed={seed}", f"training.max_steps={steps}", f"training.checkpoint_every={steps}",
           "training.tensorboard=false"]
    if variant in LDC_PRESETS:
        return out + [f"mode={LDC_PRESETS[variant]}"]
    amp = {**MODES["fp16_scaler_per_order"], **VARIANTS[variant]}
    out.append("mode=custom")
    for key, value in amp.items():
        if isinstance(value, dict):
            out += [f"amp.{key}.{k}={v}" for k, v in value.items()]
        else:
            out.append(f"amp.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


class _Autocast:
    """A float32 network whose ``apply`` runs under ``jaxamp.autocast(..., amp)``."""

    def __init__(self, model: Any, amp: Any) -> None:
        self.model = model
        self.apply = jaxamp.autocast(model.apply, amp) if amp.enabled else model.apply

    def init(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.init(*args, **kwargs)


@contextlib.contextmanager
def autocast_placement() -> Iterator[None]:
    """The examples' networks (``examples.common.train.build_model``) built in float32 and
    placed by ``jaxamp.autocast`` (which gives matmul operands per-tensor scales and FP8
    formats), instead of the modules' own dtype fields (which do not), for this block."""
    from examples.common import train

    original = train.build_model
    train.build_model = lambda cfg, amp, n_out: _Autocast(original(cfg, jaxamp.AmpConfig(enabled=False), n_out), amp)
    try:
        yield
    finally:
        train.build_model = original


def _run_ldc(variant: str, seed: int, steps: int, placement: str = "autocast") -> Dict[str, Any]:
    from examples.common.config import load_config
    from examples.common import train
    from examples.common.train import train_and_evaluate
    from examples.ldc import LDC

    overrides = _overrides(variant, steps, seed)
    cfg = load_config("ldc_demo", overrides, checks=LDC.checks)
    placed = autocast_placement() if placement == "autocast" else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="tensor_scaling_ldc_") as workdir, placed:
        s = train_and_evaluate(LDC, cfg, workdir, progress=False, plots=False)
    train._SETUPS.clear()  # its cache key does not know the placement (and frees the compiled steps)
    keep = ("skipped_steps", "first_skipped_step", "final_scale_log2", "first_nonfinite_loss_step",
            "derivative_overflow_skips", "min_scale_log2", "stalled")
    return {"error": s["rel_l2"], **{k: s.get(k) for k in keep}, "placement": placement,
            "command": "python -m examples.ldc --config ldc_demo " + " ".join(overrides)}


PROBLEMS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "jax_burgers": lambda v, seed, steps, **_: _run_port(
        "jax_user", ["--steps", str(steps), "--domain-scale", "0.02", "--seed", str(seed)], v),
    "ldc_demo": lambda v, seed, steps, ldc_placement="autocast": _run_ldc(v, seed, steps, ldc_placement),
    "flax_poisson": lambda v, seed, steps, **_: _run_port("flax_user", ["--steps", str(steps), "--seed", str(seed)], v),
}


def run(problem: str, variant: str, seed: int, steps: int, ldc_placement: str = "autocast") -> Dict[str, Any]:
    start = time.perf_counter()
    out = PROBLEMS[problem](variant, seed, steps, ldc_placement=ldc_placement)
    return {**out, "seconds": time.perf_counter() - start}


def _git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
    except OSError:
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


# ---- tables --------------------------------------------------------------------------------


def _fmt_scales(scales: Optional[Dict[str, float]]) -> str:
    if not scales:
        return "-"
    return ", ".join(f"{k}:{v:g}" for k, v in sorted(scales.items(), key=lambda kv: (kv[0] == "loss", kv[0])))


def _fmt_err(r: Dict[str, Any]) -> str:
    e, x = r["error"], r.get("over_fp32")
    if e is None or not math.isfinite(e):
        return "non-finite"
    return f"{e:.3g} ({x:.2f})" if x is not None else f"{e:.3g}"


def formats(keys: Dict[str, Any], default: Optional[Dict[str, str]] = None) -> Optional[Dict[str, str]]:
    """The matmul operand format per role of a variant's keys (None unless ``dtype="float8"``)."""
    if keys.get("dtype") != "float8":
        return None
    return {**(default or FP8_DEFAULT_ROLES), **keys.get("float8_formats", {})}


def summary(runs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per variant: its error over fp32 per (problem, seed), the median of the seeds per problem,
    and the median and max over every problem and seed."""
    out: Dict[str, Dict[str, Any]] = {}
    for r in runs:
        if r.get("over_fp32") is None:
            continue
        d = out.setdefault(r["variant"], {"formats": r.get("formats"), "over_fp32": {}})
        d["over_fp32"][f"{r['problem']}/{r['seed']}"] = r["over_fp32"]
    for d in out.values():
        by_problem: Dict[str, List[float]] = {}
        for key, x in d["over_fp32"].items():
            by_problem.setdefault(key.rsplit("/", 1)[0], []).append(x)
        d["median_over_fp32_per_problem"] = {p: statistics.median(xs) for p, xs in by_problem.items()}
        xs = list(d["over_fp32"].values())
        d["median_over_fp32"] = statistics.median(xs)
        d["max_over_fp32"] = max(xs)
    return out


_SHORT = {"float16": "fp16", "float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2"}


def _fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def tables(runs: Sequence[Dict[str, Any]]) -> str:
    """Markdown: one table per problem (variant x seed: error (x fp32), skipped steps, final
    log2 scales), then per variant the median error over fp32 of the seeds per problem and over
    every problem and seed (with the FP8 variants' operand formats: the role ablation)."""
    lines: List[str] = []
    problems = list(dict.fromkeys(r["problem"] for r in runs))
    for problem in problems:
        rows = [r for r in runs if r["problem"] == problem]
        seeds = list(dict.fromkeys(r["seed"] for r in rows))
        steps = sorted({r["steps"] for r in rows})
        lines += [f"**{problem}** ({'/'.join(map(str, steps))} steps; error: relative L2 (× fp32 at the same seed); "
                  "skipped: skipped steps; scales: final log2 scales, `loss` the loss scale)", ""]
        head = "| variant | " + " | ".join(f"seed {s} error (× fp32) | skipped | final scales" for s in seeds) + " |"
        lines += [head, "|---|" + "---|---|---|" * len(seeds)]
        order = list(VARIANTS)
        for v in sorted(dict.fromkeys(r["variant"] for r in rows),
                        key=lambda v: order.index(v) if v in order else len(order)):
            cells = []
            for s in seeds:
                r = next((r for r in rows if r["variant"] == v and r["seed"] == s), None)
                cells.append("- | - | -" if r is None else
                             f"{_fmt_err(r)} | {r.get('skipped_steps', '-')} | "
                             f"{_fmt_scales(r.get('final_scale_log2'))}")
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        lines.append("")
    summ = summary(runs)
    if summ:
        lines += ["**Error over fp32**: median of the seeds per problem; median and max over every problem and seed "
                  "(FP8 variants: the matmul operand format per role, value / tangent / cotangent)", "",
                  "| variant | formats | " + " | ".join(problems) + " | median | max | runs |",
                  "|---|---|" + "---|" * len(problems) + "---|---|---|"]
        for v, d in sorted(summ.items(), key=lambda kv: (kv[1]["median_over_fp32"], kv[0])):
            f = d["formats"]
            fmt = " / ".join(_SHORT.get(f[role], f[role]) for role in ROLES) if f else "-"
            per = [d["median_over_fp32_per_problem"].get(p) for p in problems]
            lines.append(f"| {v} | {fmt} | " + " | ".join(_fmt_ratio(x) for x in per)
                         + f" | {_fmt_ratio(d['median_over_fp32'])} | {_fmt_ratio(d['max_over_fp32'])} | "
                           f"{len(d['over_fp32'])} |")
    return "\n".join(lines) + "\n"


def _load_runs(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """The runs of result files; a run's ``formats`` from the recipe its file was measured with."""
    runs: List[Dict[str, Any]] = []
    for p in paths:
        with open(p) as f:
            record = json.load(f)
        default = record.get("info", {}).get("fp8_default_roles", FP8_UNRECORDED_ROLES)
        runs += [{"formats": formats(r.get("keys", {}), default), **r} for r in record["runs"]]
    # a run repeated in a later file is left out: the first file given wins
    seen, kept = set(), []
    for r in runs:
        key = (r["problem"], r["seed"], r["steps"], r["variant"])
        if key not in seen:
            seen.add(key)
            kept.append(r)
    runs = kept
    # a file run without fp32 takes its ratio from an fp32 run of the same problem, seed and steps
    base = {(r["problem"], r["seed"], r["steps"]): r["error"] for r in runs if r["variant"] == "fp32"}
    for r in runs:
        b = base.get((r["problem"], r["seed"], r["steps"]))
        if r.get("over_fp32") is None and b is not None:
            r["over_fp32"] = r["error"] / b if math.isfinite(r["error"]) else math.inf
    return runs


def main(argv=None) -> Dict[str, Any]:
    description, _, epilog = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tensor_scaling", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    ap.add_argument("--problem", nargs="+", choices=list(PROBLEMS), default=["jax_burgers"],
                    help="problems to run (default: jax_burgers)")
    ap.add_argument("--steps", type=int, default=None, help=f"steps of every problem (default: {DEFAULT_STEPS})")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS))
    ap.add_argument("--ldc-placement", choices=("autocast", "modules"), default="autocast",
                    help="ldc_demo's network: float32 modules under jaxamp.autocast (default, as measured), or the "
                    "modules' own dtype fields (the demo's; they ignore tensor_scaling and FP8 before 6167fd4)")
    ap.add_argument("--out", default=None, help="JSON file, rewritten after every run")
    ap.add_argument("--tables", nargs="+", metavar="JSON", default=None,
                    help="print the markdown tables of these result files and exit (runs nothing)")
    args = ap.parse_args(argv)
    if args.tables:
        runs = _load_runs(args.tables)
        print(tables(runs), end="")
        return {"runs": runs, "summary": summary(runs)}
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps={args.steps} must be >= 1")
    record: Dict[str, Any] = {
        "benchmark": "tensor_scaling",
        "info": {**device_info(), "cpu_model": _cpu_model(), "commit": _git_commit(),
                 "date": time.strftime("%Y-%m-%d"), "fp8_default_roles": FP8_DEFAULT_ROLES},
        "config": vars(args), "runs": [],
    }
    for problem in args.problem:
        steps = args.steps or DEFAULT_STEPS[problem]
        for seed in args.seeds:
            base = None
            for variant in args.variants:
                out = run(problem, variant, seed, steps, args.ldc_placement)
                base = out["error"] if variant == "fp32" else base
                over = None if base is None else (out["error"] / base if math.isfinite(out["error"]) else math.inf)
                row = {"problem": problem, "steps": steps, "seed": seed, "variant": variant, "keys": VARIANTS[variant],
                       "formats": formats(VARIANTS[variant]), **out, "over_fp32": over}
                record["runs"].append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(record, f, indent=1)
    record["summary"] = summary(record["runs"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
