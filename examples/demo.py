"""The fp16 demonstration: one problem, every mode, a results table.

``python -m examples.demo [--config ldc_demo] [--seeds 0 1 2] [--modes ...] [--workdir runs/demo]
[key=value ...]`` trains the configured problem once per (seed, mode) and writes
``results.json`` and ``results.md`` in the workdir: relative L2 error, its ratio to fp32's,
the first step with a non-finite loss, and the skipped steps of each run. The claim it checks:
``fp16_plain`` hits a non-finite loss (derivative overflow) while each ``fp16_scaler_*`` mode
ends within 1.2x of fp32's relative L2.
"""

from __future__ import annotations

import jaxamp

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from examples.common.config import MODES, ConfigError, load_config

RATIO_LIMIT = 1.2


def problems() -> Dict[str, Any]:
    from examples.burgers import Burgers
    from examples.helmholtz import Helmholtz
    from examples.ldc import LDC

    return {c.name: c for c in (LDC, Burgers, Helmholtz)}


def run_demo(config: str, seeds: Sequence[int], modes: Sequence[str], workdir: str,
             overrides: Sequence[str] = (), progress: bool = True) -> List[Dict[str, Any]]:
    """Train every (seed, mode); return one row per run (also written to workdir)."""
    from examples.common.train import train_and_evaluate

    probe = load_config(config, overrides)  # name + common checks first, before any training
    registry = problems()
    if probe["name"] not in registry:
        raise ConfigError(f"name={probe['name']!r} is not allowed: expected one of {sorted(registry)}.")
    cls = registry[probe["name"]]
    cfgs = {(s, m): load_config(config, [*overrides, f"mode={m}", f"seed={s}"], checks=cls.checks)
            for s in seeds for m in modes}
    rows = []
    for (seed, mode), cfg in cfgs.items():
        run_dir = os.path.join(workdir, f"seed{seed}", mode)
        done = os.path.join(run_dir, "summary.json")
        if os.path.exists(done) and os.path.exists(os.path.join(run_dir, "checkpoints")):
            summary = train_and_evaluate(cls, cfg, run_dir, resume=True, progress=progress)
        else:
            summary = train_and_evaluate(cls, cfg, run_dir, resume=os.path.exists(run_dir), progress=progress)
        rows.append(summary)
    write_table(rows, workdir)
    return rows


def write_table(rows: List[Dict[str, Any]], workdir: str) -> str:
    fp32 = {r["seed"]: r["rel_l2"] for r in rows if r["mode"] == "fp32"}
    lines = [
        "| seed | mode | rel. L2 | / fp32 | first non-finite loss step | skipped steps | deriv. overflow skips | final log2 scales |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        r["ratio_to_fp32"] = r["rel_l2"] / fp32[r["seed"]] if r["seed"] in fp32 else None
        ratio = f"{r['ratio_to_fp32']:.2f}" if r["ratio_to_fp32"] is not None else "-"
        scales = ", ".join(f"{k}:{v:g}" for k, v in r.get("final_scale_log2", {}).items())
        lines.append(
            f"| {r['seed']} | {r['mode']} | {r['rel_l2']:.4g} | {ratio} | {r['first_nonfinite_loss_step'] or '-'} "
            f"| {r['skipped_steps']} | {r['derivative_overflow_skips']} | {scales} |"
        )
    text = "\n".join(lines) + "\n"
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="ldc_demo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        rows = run_demo(args.config, args.seeds, args.modes, args.workdir, args.overrides, not args.no_progress)
    except jaxamp.ConfigError as e:  # the examples' and AmpConfig's config errors
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(open(os.path.join(args.workdir, "results.md")).read())
    del rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
