"""``python -m benchmarks.same_program``: fingerprints of the compiled programs the timing
benchmarks measure, to compare two commits.

Each program of ``python -m benchmarks matrix`` (every problem, placement and mode), of
``python -m benchmarks peers`` (jaxamp's float32 Laplacian value and step and its float16 user
step, per dimension) and the idioms of ``python -m benchmarks idioms`` (nested ``grad``, tuple
``argnums``, ``jacfwd`` / ``jacrev`` + ``hessian``: the programs the chain planner expands) is
compiled for this CPU and fingerprinted: the SHA-256 of XLA's optimised HLO text with its metadata
(source locations) removed. Run from git worktrees of two commits; equal fingerprints mean the
timings and FLOPs measured at one commit are those of the other's programs.

    python -m benchmarks.same_program --out A.json          # in a worktree of commit A
    python -m benchmarks.same_program --compare A.json B.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp

from benchmarks import idioms, matrix, peers
from benchmarks.laplacian import init_mlp
from benchmarks.problems import PROBLEMS, make_batch
from jaxamp.models import FullyConnected

_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")
# the source-location tables XLA appends to the text: which lines of which files traced the program
_LOCATION_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program_text(compiled: Any) -> str:
    """The compiled program's HLO text without metadata or source-location tables."""
    kept, skipping = [], False
    for line in compiled.as_text().splitlines():
        if line.strip() in _LOCATION_TABLES:
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            kept.append(_METADATA.sub("", line))
    return "\n".join(kept)


def fingerprint(compiled: Any) -> str:
    """SHA-256 of :func:`program_text`."""
    return hashlib.sha256(program_text(compiled).encode()).hexdigest()


def matrix_programs(cfg: Dict[str, int]) -> Dict[str, str]:
    out = {}
    for name, problem in PROBLEMS.items():
        net = FullyConnected(out_features=len(problem.outputs), layer_size=cfg["width"], nr_layers=cfg["layers"])
        params = net.init(jax.random.PRNGKey(0), jnp.zeros(len(problem.inputs)))
        batch = make_batch(problem, cfg["n"], cfg["nb"])
        for placement in matrix.PLACEMENTS:
            for mode in matrix.MODES:
                case = matrix.build_case(problem, placement, mode, params, batch, cfg["layers"], cfg["width"])
                out[f"matrix/{name}/{placement}/{mode}"] = fingerprint(case.compiled)
    return out


def peers_programs(dims: List[int], points: int) -> Dict[str, str]:
    out = {}
    for d in dims:
        params = init_mlp(d, 64, 4)
        x = jax.random.uniform(jax.random.PRNGKey(1), (points, d), jnp.float32, -1.0, 1.0)
        for work, fn, args in (("value", peers.value_fn("jaxamp"), (params, x)),
                               ("step", peers.step_fn("jaxamp"), (params, x)),
                               ("fp16_step", *peers.fp16_step(params, x))):
            out[f"peers/d={d}/{work}"] = fingerprint(jax.jit(fn).lower(*args).compile())
    return out


def idiom_programs(points: int) -> Dict[str, str]:
    out = {}
    for name in ("burgers_k1", "burgers_k2", "poisson2d", "ns2d"):
        for idiom in ("nested", "tuple", "jacfwd", "jacrev"):
            step, args = idioms.step_fn(name, idiom, points)
            out[f"idioms/{name}/{idiom}"] = fingerprint(step.lower(*args).compile())
    return out


def compare(a: Dict[str, Any], b: Dict[str, Any]) -> int:
    """Print the programs whose fingerprints differ; 0 when every common program is the same."""
    fa, fb = a["programs"], b["programs"]
    common = sorted(set(fa) & set(fb))
    differ = [k for k in common if fa[k] != fb[k]]
    for k in differ:
        print(f"differs: {k}")
    print(f"{len(common) - len(differ)} of {len(common)} programs identical ({a['commit']} vs {b['commit']})")
    return 1 if differ else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.same_program", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the fingerprints here (JSON)")
    ap.add_argument("--commit", default="", help="the commit name recorded with the fingerprints")
    ap.add_argument("--dims", type=int, nargs="+", default=[2, 8, 32, 100])
    ap.add_argument("--sections", nargs="+", choices=("matrix", "peers", "idioms"),
                    default=["matrix", "peers", "idioms"])
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two fingerprint files to compare")
    a = ap.parse_args(argv)
    if a.compare:
        with open(a.compare[0]) as fa, open(a.compare[1]) as fb:
            return compare(json.load(fa), json.load(fb))
    cfg = dict(matrix.PRESETS["cpu"])
    programs: Dict[str, str] = {}
    if "matrix" in a.sections:
        programs.update(matrix_programs(cfg))
    if "peers" in a.sections:
        programs.update(peers_programs(a.dims, 1000))
    if "idioms" in a.sections:
        programs.update(idiom_programs(2000))
    res = {"commit": a.commit, "jax": jax.__version__, "programs": programs}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{len(programs)} programs fingerprinted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
