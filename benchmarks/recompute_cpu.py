"""``python -m benchmarks.recompute_cpu OUT.json``: the problem matrix's per-order step (``benchmarks/matrix.py``,
preset ``cpu``, placements ``default`` and ``all_fp16``) with ``AmpConfig.recompute_float32`` on (the default)
against off: paired step-time ratios (9 interleaved rounds) and XLA's FLOPs ratio, on the CPU."""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional

import jaxamp

from benchmarks import matrix, timing
from benchmarks.problems import PROBLEMS


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    matrix.PLACEMENTS["default_stored"] = jaxamp.AmpConfig(recompute_float32=False)
    matrix.PLACEMENTS["all_fp16_stored"] = jaxamp.AmpConfig(autocast_activation=True, autocast_firstlayer=True,
                                                            recompute_float32=False)
    cfg = {**matrix.PRESETS["cpu"], "reps": 9}
    out: Dict[str, Any] = {}
    for name in ("poisson1d", "cavity", "unsteady_ns", "ks"):
        res = matrix.bench_problem(PROBLEMS[name], cfg, ["default", "default_stored", "all_fp16", "all_fp16_stored"],
                                   ["per_order"])
        row = {}
        for pl in ("default", "all_fp16"):
            a, b = res["cases"][f"{pl}/per_order"], res["cases"][f"{pl}_stored/per_order"]
            row[pl] = {"time_ratio": timing.paired_ratio(a["samples_s"], b["samples_s"]),
                       "flops_ratio": a["flops"] / b["flops"], "recomputed_ms": a["step_s"], "stored_ms": b["step_s"]}
        out[name] = row
        print(name, json.dumps(row), flush=True)
    if argv:
        with open(argv[0], "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
