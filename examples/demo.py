"""The fp16 demonstration: one problem, every mode, a results table.

``python -m examples.demo [--config ldc_demo] [--seeds 0 1 2] [--modes ...] [--workdir runs/demo]
[key=value ...]`` trains the configured problem once per (seed, mode) and writes
``results.json`` and ``results.md`` in the workdir: relative L2 error, its ratio to fp32's,
the first step with a non-finite loss, and the skipped steps of each run. The claim it checks:
``fp16_plain`` hits a non-finite loss (derivative overflow) while each ``fp16_scaler_*`` mode
ends within 1.2x of fp32's relative L2. It prints the table, where the outputs went, and a
last line with each run's verdict (trained, or stalled and why: :mod:`examples.common.verdict`).
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
             overrides: Sequence[str] = (), progress: bool = True, plots: bool = True) -> List[Dict[str, Any]]:
    """Train every (seed, mode); return one row per run (also written to workdir).

    Every config is loaded and checked before the first run starts. A run whose workdir
    already holds checkpoints is resumed (a finished one only re-evaluated), so an
    interrupted demo continues where it stopped.
    """
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
        resume = os.path.isdir(os.path.join(run_dir, "checkpoints"))
        summary = train_and_evaluate(cls, cfg, run_dir, resume=resume, progress=progress, plots=plots)
        rows.append({**summary, "workdir": run_dir})
    write_table(rows, workdir)
    if plots:
        from examples.common.plots import plot_comparison
        from examples.common.train import read_metrics

        for seed in seeds:
            runs = {r["mode"]: read_metrics(os.path.join(r["workdir"], "metrics.jsonl"))
                    for r in rows if r["seed"] == seed}
            plot_comparison(os.path.join(workdir, f"seed{seed}"), runs, title=f"{probe['name']} seed {seed}")
    return rows


def verdicts(rows: List[Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """Per seed, the demo's claim: plain fp16 failed (non-finite loss, or skipped steps from a
    derivative overflow) and every ``fp16_scaler_*`` run is within :data:`RATIO_LIMIT` of fp32."""
    out: Dict[int, Dict[str, Any]] = {}
    for seed in dict.fromkeys(r["seed"] for r in rows):
        by_mode = {r["mode"]: r for r in rows if r["seed"] == seed}
        plain, fp32 = by_mode.get("fp16_plain"), by_mode.get("fp32")
        scaled = {m: r for m, r in by_mode.items() if m.startswith("fp16_scaler")}
        v: Dict[str, Any] = {}
        if plain is not None:
            v["plain_failed"] = plain["first_nonfinite_loss_step"] is not None
            v["plain_failure_step"] = plain["first_nonfinite_loss_step"]
            v["plain_skipped_steps"] = plain["skipped_steps"]
        if fp32 is not None and scaled:
            v["scaler_ratios"] = {m: r["rel_l2"] / fp32["rel_l2"] for m, r in scaled.items()}
            v["scaler_within_limit"] = all(x <= RATIO_LIMIT for x in v["scaler_ratios"].values())
        if "plain_failed" in v and "scaler_within_limit" in v:
            v["claim_holds"] = v["plain_failed"] and v["scaler_within_limit"]
        out[seed] = v
    return out


def _verdict_line(seed: int, v: Dict[str, Any]) -> str:
    parts = [f"seed {seed}:"]
    if "plain_failed" in v:
        parts.append(f"fp16_plain first non-finite loss at step {v['plain_failure_step']}, "
                     f"{v['plain_skipped_steps']} steps skipped;" if v["plain_failed"]
                     else "fp16_plain never had a non-finite loss;")
    if "scaler_ratios" in v:
        parts.append(", ".join(f"{m} {x:.2f}x fp32" for m, x in v["scaler_ratios"].items())
                     + f" (limit {RATIO_LIMIT}x);")
    if "claim_holds" in v:
        parts.append("claim holds" if v["claim_holds"] else "claim does NOT hold")
    return " ".join(parts)


def write_table(rows: List[Dict[str, Any]], workdir: str) -> str:
    fp32 = {r["seed"]: r["rel_l2"] for r in rows if r["mode"] == "fp32"}
    lines = [
        "| seed | mode | rel. L2 | / fp32 | first non-finite loss step | skipped steps | deriv. overflow skips "
        "| final log2 scales | train s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        r["ratio_to_fp32"] = r["rel_l2"] / fp32[r["seed"]] if r["seed"] in fp32 else None
        ratio = f"{r['ratio_to_fp32']:.2f}" if r["ratio_to_fp32"] is not None else "-"
        scales = ", ".join(f"{k}:{v:g}" for k, v in r.get("final_scale_log2", {}).items())
        lines.append(
            f"| {r['seed']} | {r['mode']} | {r['rel_l2']:.4g} | {ratio} | {r['first_nonfinite_loss_step'] or '-'} "
            f"| {r['skipped_steps']} | {r['derivative_overflow_skips']} | {scales} "
            f"| {r['train_seconds']:.0f} |"
        )
    checks = verdicts(rows)
    lines += [""] + [_verdict_line(seed, v) for seed, v in checks.items()]
    lines += [f"seed {r['seed']} {r['mode']} stopped early: {r['stalled']}" for r in rows if r.get("stalled")]
    text = "\n".join(lines) + "\n"
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"runs": rows, "verdicts": {str(k): v for k, v in checks.items()}}, f, indent=2)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(text)
    return text


BEGIN, END = "<!-- demo-report:begin -->", "<!-- demo-report:end -->"


def provenance() -> str:
    """Where the numbers come from: commit, CPU model, JAX version, date (fp16 digits differ
    between CPUs: XLA keeps excess precision in CPU fusions)."""
    import platform
    import subprocess

    def run(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    commit = run("git", "rev-parse", "--short", "HEAD") or "unknown"
    dirty = " (with uncommitted changes)" if run("git", "status", "--porcelain", "--untracked-files=no") else ""
    cpu = next((line.split(":", 1)[1].strip() for line in run("lscpu").splitlines() if line.startswith("Model name")),
               platform.processor() or platform.machine())
    import datetime

    import jax

    return (f"Measured at commit {commit}{dirty}, CPU {cpu} ({os.cpu_count()} cores), JAX {jax.__version__}, "
            f"{datetime.date.today().isoformat()}; fp16 digits differ between CPUs.")


def write_report(path: str, table: str, command: str, origin: str) -> None:
    """Put ``table`` with its provenance ``origin`` between the report markers of ``path``
    (appended with markers when the file has none): numbers on the page come from a run."""
    block = f"{BEGIN}\n`{command}`\n\n{origin}\n\n{table.rstrip()}\n{END}"
    text = open(path).read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="ldc_demo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--report", metavar="PATH", help="also write the table, with the commit, CPU and JAX "
                        "version it came from, between the report markers of PATH (e.g. docs/demonstration.md)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    origin = provenance()  # the code the runs import: the commit when they start, not when they end
    try:
        rows = run_demo(args.config, args.seeds, args.modes, args.workdir, args.overrides,
                        progress=not args.no_progress, plots=not args.no_plots)
    except jaxamp.ConfigError as e:  # the examples' and AmpConfig's config errors
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from examples.common.verdict import outputs_line, table_verdict

    table = open(os.path.join(args.workdir, "results.md")).read()
    print(table)
    if args.report:
        command = "python -m examples.demo " + " ".join(sys.argv[1:] if argv is None else argv)
        write_report(args.report, table, command, origin)
        print(f"report: {os.path.abspath(args.report)}")
    print(outputs_line(args.workdir) + "; each run in seed<seed>/<mode>/, comparison.png per seed")
    print(table_verdict(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
