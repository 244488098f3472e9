"""Two commits' benchmark matrices side by side: XLA FLOPs, compile time and step time.

    python -m benchmarks.matrix_compare --base OLD.json [OLD2.json ...] --new NEW.json [NEW2.json ...]

Each JSON is one ``python -m benchmarks matrix`` run (the ``base`` runs from a git worktree of the
older commit, ``git worktree add /tmp/old REV``). Runs of the two commits are best alternated
(new, old, new, old): step times of separate processes drift with the machine's load, so the
step-time ratio is that of the medians over every run's median, and only FLOPs (deterministic)
are exact. Cases present in both (problem / placement / mode) are compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Dict, List


def _cases(paths: List[str]) -> Dict[str, List[Dict[str, Any]]]:
    """``{problem/placement/mode: [case of each run]}``."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        for problem, body in res["problems"].items():
            for name, case in body["cases"].items():
                out.setdefault(f"{problem}/{name}", []).append(case)
    return out


def compare(base: List[str], new: List[str]) -> Dict[str, Dict[str, float]]:
    """``{case: {"flops", "compile", "step"}}``: new over base."""
    old, cur = _cases(base), _cases(new)
    rows = {}
    for name in [n for n in cur if n in old]:
        med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
        rows[name] = {"flops": med(cur[name], "flops") / med(old[name], "flops"),
                      "compile": med(cur[name], "compile_s") / med(old[name], "compile_s"),
                      "step": statistics.median(r["step_s"]["median"] for r in cur[name])
                      / statistics.median(r["step_s"]["median"] for r in old[name])}
    return rows


def main(argv=None) -> Dict[str, Dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", nargs="+", required=True, help="matrix JSONs of the older commit")
    ap.add_argument("--new", nargs="+", required=True, help="matrix JSONs of the newer commit")
    ap.add_argument("--out", help="write the ratios as JSON here")
    args = ap.parse_args(argv)
    rows = compare(args.base, args.new)
    print("| case | XLA FLOPs | compile | step time |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['flops']:.4f} | {r['compile']:.2f} | {r['step']:.2f} |")
    steps = sorted(r["step"] for r in rows.values())
    print(f"\n{len(rows)} cases; FLOPs new/base {min(r['flops'] for r in rows.values()):.4f}-"
          f"{max(r['flops'] for r in rows.values()):.4f}; step time median {statistics.median(steps):.2f} "
          f"(range {steps[0]:.2f}-{steps[-1]:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"base": args.base, "new": args.new, "ratios": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
