"""``python -m benchmarks matrix``: the DerivScaler's cost over a matrix of PINN problems.

For every problem of :data:`benchmarks.problems.PROBLEMS` and every case
``<placement>/<mode>`` the whole jitted train step (``jaxamp.make_train_step``, Adam) is
compiled on shared weights and points, and measured:

- placements: ``default`` (``FullyConnected.from_amp(AmpConfig())``: first layer and
  activations float32), ``all_fp16`` (``autocast_activation=True,
  autocast_firstlayer=True``: everything float16) and, on request, ``autocast`` (the float32
  network placed by ``jaxamp.autocast`` with ``all_fp16``'s keys: the matmuls' operands in
  float16, the other operations float32, so per-tensor scales act on float32 operands);
- modes: ``plain`` (``derivative_scaling=False``: plain fp16, the loss scaler only),
  ``per_order`` (the default DerivScaler), ``per_term`` (``mode="per_term_scaler"``) and
  ``tensor`` (per order with per-tensor scaling of every float16 matmul operand);
  network, engine, state and step all take the case's ``AmpConfig``.

Reported per case: step time (wall clock; process CPU time next to it, which other
processes' load disturbs less), XLA's FLOPs and bytes accessed (``cost_analysis``), XLA's
temporary buffer size (``memory_analysis``), compile time, and whether the first step's
parameters are bit-identical to plain fp16's (scales start at 1, so a scaler that does not
act should change nothing). Ratios scaled / plain are paired per interleaved repetition
(median, p25, p75), per placement.

    python -m benchmarks matrix [--quick] [--problems cavity ks] [--reps 15] [--inner 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp
import optax

import jaxamp
from jaxamp.models import FullyConnected

from benchmarks import timing
from benchmarks.problems import PROBLEMS, Problem, make_batch

PLACEMENTS = {
    "default": jaxamp.AmpConfig(),
    "all_fp16": jaxamp.AmpConfig(autocast_activation=True, autocast_firstlayer=True),
    "autocast": jaxamp.AmpConfig(autocast_activation=True, autocast_firstlayer=True),
}
DEFAULT_PLACEMENTS = ("default", "all_fp16")
MODES = {
    "plain": dict(derivative_scaling=False),
    "per_order": dict(mode="per_order_scaler"),
    "per_term": dict(mode="per_term_scaler"),
    "tensor": dict(mode="per_order_scaler", tensor_scaling=True),  # per order + per-tensor scales
}
# Network and batch per preset: LAYERS x WIDTH tanh, N interior and NB boundary points.
PRESETS = {
    "quick": dict(layers=2, width=16, n=64, nb=16, reps=3, inner=1),
    "cpu": dict(layers=4, width=64, n=2000, nb=500, reps=15, inner=3),
    "gpu": dict(layers=4, width=64, n=2000, nb=500, reps=30, inner=10),
}


def case_amp(placement: str, mode: str) -> jaxamp.AmpConfig:
    """The ``AmpConfig`` of a case: the placement's keys with the mode's."""
    return dataclasses.replace(PLACEMENTS[placement], **MODES[mode])


@dataclasses.dataclass
class Case:
    """One compiled train step of the matrix."""

    name: str
    state: jaxamp.TrainState
    compiled: Any
    compile_s: float


def build_case(problem: Problem, placement: str, mode: str, params: Any, batch: Dict[str, jax.Array],
               layers: int, width: int, merge: bool = False, on_stall: Any = None) -> Case:
    """Compile the train step of ``problem`` for one placement and mode (public jaxamp API only);
    ``merge`` and ``on_stall`` as :func:`jaxamp.make_train_step`'s."""
    amp = case_amp(placement, mode)
    shape = dict(out_features=len(problem.outputs), layer_size=width, nr_layers=layers, activation="tanh")
    if placement == "autocast":
        apply = jaxamp.autocast(FullyConnected(**shape).apply, amp)
    else:
        apply = FullyConnected.from_amp(amp, **shape).apply
    engine = jaxamp.Derivatives(lambda p, x: apply(p, x), inputs=problem.inputs, outputs=problem.outputs,
                                derivatives=problem.derivatives, amp=amp)

    def loss_fn(p, b):
        d = engine(p, b["interior"])
        terms = {k: jnp.mean(r**2) for k, r in problem.residuals(d, b["interior"]).items()}
        y = jax.vmap(lambda x: apply(p, x))(b["boundary"])
        terms["boundary"] = jnp.mean((y[:, : b["target"].shape[1]] - b["target"]) ** 2)
        return sum(terms.values()), terms

    opt = optax.adam(1e-3)
    state = jaxamp.TrainState.create(params=params, optimizer=opt, amp=amp, engines=[engine])
    step = jaxamp.make_train_step(loss_fn, opt, amp=amp, merge=merge, on_stall=on_stall)
    t = time.perf_counter()
    compiled = jax.jit(step).lower(state, batch).compile()
    case = Case(f"{problem.name}/{placement}/{mode}", state, compiled, time.perf_counter() - t)
    print(f"compiled {case.name} in {case.compile_s:.1f} s", file=sys.stderr, flush=True)
    case.name = f"{placement}/{mode}"
    return case


def clocked(case: Case, batch: Dict[str, jax.Array], inner: int, cpu_log: List[float]):
    """A function for :func:`timing.interleaved`: ``inner`` steps, wall seconds per step
    returned, process CPU seconds per step appended to ``cpu_log``."""
    holder = {"state": case.state}

    def fn() -> float:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(inner):
            holder["state"], metrics = case.compiled(holder["state"], batch)
        jax.block_until_ready(metrics["loss"])
        cpu_log.append((time.process_time() - c) / inner)
        return (time.perf_counter() - t) / inner

    return fn


def bench_problem(problem: Problem, cfg: Dict[str, Any], placements: List[str], modes: List[str]) -> Dict[str, Any]:
    """Compile, check and time every case of one problem, interleaved."""
    net = FullyConnected(out_features=len(problem.outputs), layer_size=cfg["width"], nr_layers=cfg["layers"])
    params = net.init(jax.random.PRNGKey(0), jnp.zeros(len(problem.inputs)))
    batch = make_batch(problem, cfg["n"], cfg["nb"])
    cases = [build_case(problem, pl, m, params, batch, cfg["layers"], cfg["width"]) for pl in placements for m in modes]
    out: Dict[str, Any] = {"derivatives": list(problem.derivatives), "inputs": list(problem.inputs),
                           "outputs": list(problem.outputs), "cases": {}, "ratios": {}}
    first: Dict[str, Any] = {}
    for c in cases:
        new_state, metrics = c.compiled(c.state, batch)
        first[c.name] = (jax.device_get(new_state.params), float(metrics["loss"]))
        out["cases"][c.name] = {"compile_s": c.compile_s, **timing.cost_of(c.compiled),
                                "xla_memory": timing.memory_of(c.compiled), "first_loss": first[c.name][1],
                                "first_skipped": bool(metrics["skipped"])}
    for c in cases:
        plain = c.name.split("/")[0] + "/plain"
        if plain in first and plain != c.name:
            same = jax.tree_util.tree_all(jax.tree_util.tree_map(
                lambda a, b: bool((a == b).all()), first[c.name][0], first[plain][0]))
            out["cases"][c.name]["first_step_params_identical_to_plain"] = same
    cpu: Dict[str, List[float]] = {c.name: [] for c in cases}
    wall = timing.interleaved({c.name: clocked(c, batch, cfg["inner"], cpu[c.name]) for c in cases}, cfg["reps"])
    for name in wall:
        cpu[name] = cpu[name][-len(wall[name]):]  # drop the warm-up round
        out["cases"][name].update(step_s=timing.stats(wall[name]), cpu_s=timing.stats(cpu[name]),
                                  samples_s=wall[name], cpu_samples_s=cpu[name])
    for pl in placements:
        for m in modes:
            a, b = f"{pl}/{m}", f"{pl}/plain"
            if m != "plain" and b in wall:
                out["ratios"][f"{a} / plain"] = {"wall": timing.paired_ratio(wall[a], wall[b]),
                                                 "cpu": timing.paired_ratio(cpu[a], cpu[b])}
    return out


def print_matrix(res: Dict[str, Any]) -> None:
    """The matrix as plain-text tables (times: median [p25, p75])."""
    m = res["meta"]
    print(f"backend={m['backend']} device={m['device_kind']} jax={m['jax']} preset={m['preset']} "
          f"net {m['config']['layers']}x{m['config']['width']} tanh, {m['config']['n']} points, "
          f"{m['config']['reps']} reps x {m['config']['inner']} steps")
    for name, p in res["problems"].items():
        print(f"\n== {name}: {len(p['derivatives'])} derivatives {p['derivatives']}")
        hdr = ["case", "step ms", "cpu ms", "GFLOP", "MB accessed", "temp MiB", "compile s", "1st step == plain"]
        rows = [hdr]
        for case, r in p["cases"].items():
            s = r["step_s"]
            rows.append([case, f"{s['median'] * 1e3:.2f} [{s['p25'] * 1e3:.2f}, {s['p75'] * 1e3:.2f}]",
                         f"{r['cpu_s']['median'] * 1e3:.2f}", f"{(r['flops'] or 0) / 1e9:.3f}",
                         f"{(r['bytes_accessed'] or 0) / 1e6:.1f}",
                         f"{(r['xla_memory']['temp_bytes'] or 0) / 2**20:.2f}", f"{r['compile_s']:.1f}",
                         str(r.get("first_step_params_identical_to_plain", "-"))])
        widths = [max(len(row[i]) for row in rows) for i in range(len(hdr))]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        for k, r in p["ratios"].items():
            w, c = r["wall"], r["cpu"]
            print(f"  {k}: wall {w['median']:.3f} [{w['p25']:.3f}, {w['p75']:.3f}]  "
                  f"cpu {c['median']:.3f} [{c['p25']:.3f}, {c['p75']:.3f}]")


def _load() -> Optional[float]:
    """The host's 1-minute load average (other work skews CPU timings: record it)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 repetitions: checks that it runs")
    ap.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), default=list(DEFAULT_PLACEMENTS))
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    for key in ("reps", "inner", "layers", "width", "n", "nb"):
        ap.add_argument(f"--{key}", type=int, help=f"override the preset's {key}")
    ap.add_argument("--out", help="JSON file (default: benchmarks/results/matrix-<date>.json; none with --quick)")
    a = ap.parse_args(argv)
    preset = "quick" if a.quick else a.preset
    cfg = dict(PRESETS[preset])
    for key in ("reps", "inner", "layers", "width", "n", "nb"):
        v = getattr(a, key)
        if v is not None:
            if v < 1:
                ap.error(f"--{key}={v} must be >= 1")
            cfg[key] = v
    if "plain" not in a.modes:
        ap.error(f"--modes {a.modes}: include 'plain', the reference of every ratio")
    t0 = time.perf_counter()
    res: Dict[str, Any] = {"meta": {**timing.device_info(), "preset": preset, "config": cfg,
                                    "argv": sys.argv if argv is None else argv,
                                    "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                    "load_avg_1min_start": _load()}, "problems": {}}
    out = a.out or (None if a.quick else f"benchmarks/results/matrix-{time.strftime('%Y-%m-%d')}.json")
    for name in a.problems:
        res["problems"][name] = bench_problem(PROBLEMS[name], cfg, a.placements, a.modes)
        res["problems"][name]["elapsed_s"] = time.perf_counter() - t0
        res["meta"]["total_s"] = time.perf_counter() - t0
        res["meta"]["process_cpu_s"] = time.process_time()  # compile + run, less sensitive to load
        res["meta"]["load_avg_1min_end"] = _load()
        if out:  # after every problem: a run cut short keeps what it measured
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
    print_matrix(res)
    if out:
        print(f"\nwrote {out} ({res['meta']['total_s']:.0f} s)")
    return res
