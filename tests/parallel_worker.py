"""Multi-device checks for jaxamp.parallel, run in a subprocess by tests/test_parallel.py.

The device count of JAX's CPU backend is fixed when JAX starts, so this script runs with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` in its own process and prints one
JSON object of raw measurements on its last stdout line; the test makes the assertions.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python tests/parallel_worker.py [--steps 100] [--part fp32|fp16|all] [--devices 1,2,8]

What it records, for meshes of ``--devices`` devices (the first n of the 8 fake devices);
``--part fp32`` / ``--part fp16`` run half of it, so the test can run both halves at once:
- ``float32``: the loss of every step of a float32 run (AMP scalers inactive);
- ``float16``: loss, skipped flags and every scaler's log2 scale per step of a float16 run in
  which one collocation point (global index ``BAD_INDEX``, so a different device for each
  mesh size) is NaN at steps ``NAN_STEPS`` (bad values) and carries an overflow flag for
  scaler key "2" at steps ``OVERFLOW_STEPS``; both are injected, so nothing depends on XLA's
  excess-precision choices;
- ``inject`` (needs 8 devices): the state after ``K`` clean steps, then one step whose NaN
  lies only in device ``BAD_DEVICE``'s shard and one step whose overflow flag lies only in
  that shard: each step's metrics, whether every shard of the new params/optimizer
  state/loss scale equals the old bit for bit, whether all replicas of the new state are
  bit-identical, and the scaler states before/after;
- ``hlo`` (8 devices): the collective ops in the compiled fp16 step;
- ``errors``: the messages for a batch that does not divide over 8 devices.

``--multihost PROCESS_ID --port P`` instead runs one of two processes of a multi-host check
(``jax.distributed.initialize`` over localhost, gloo CPU collectives, 2 fake devices each).
"""

from __future__ import annotations

import argparse
import json
import re
import os
import sys
from typing import Any, Dict, List

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    sys.exit("parallel_worker.py: set XLA_FLAGS=--xla_force_host_platform_device_count=N (8; 2 for --multihost).")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxamp  # noqa: E402
from jaxamp._src.training import parallel  # noqa: E402
from jaxamp._src.derivatives.plan import mark_params  # noqa: E402
from jaxamp._src.core.marks import deriv_check  # noqa: E402
from jaxamp.models import FullyConnected# noqa: E402

GLOBAL_BATCH = 64
BAD_INDEX = 37  # device 0 of 1, device 1 of 2, device 4 of 8 (shards of 64, 32, 8 points)
NAN_STEPS = (20, 21)  # a NaN point: bad values, skipped, no scaler changes
OVERFLOW_STEPS = (30, 31)  # two consecutive overflows of key "2": its scaler backs off twice
K, BAD_DEVICE = 5, 5  # injection test: a NaN, then an overflow flag, in device 5's shard after K steps


def amp_config(dtype: str) -> jaxamp.AmpConfig:
    return jaxamp.AmpConfig(
        dtype=dtype,
        default_max_scale_log2=2,  # derivative scalers may grow to 4: a trajectory with growth
        derivative_scaler={"growth_interval": 4, "recover_growth_interval": 2},
        loss_scaler={"init_scale": 2.0**10, "growth_interval": 8, "recover_growth_interval": 4},
    )


def build(dtype: str):
    """Model, engine-based Poisson loss, optimizer, initial state and the pure step."""
    amp = amp_config(dtype)
    model = FullyConnected.from_amp(amp, out_features=1, layer_size=16, nr_layers=2)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(1))
    engine = jaxamp.Derivatives(
        lambda p, x: model.apply(p, x), inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=amp
    )

    def loss_fn(p, batch):
        d = engine(p, {"x": batch["x"]})
        # An overflow of key "2" flagged at chosen points: the global any() needs every shard.
        # A marked check of an infinite derivative of a finite value at those points, OR-ed by
        # the step into key "2"'s flag (inert in float32, which has no derivative scalers).
        if "2" in engine.scaler_keys:
            overflow = jnp.where(batch["overflow"], jnp.float32(jnp.inf), jnp.float32(0.0))
            deriv_check(overflow, jnp.zeros_like(batch["x"]), **mark_params("2"))
        r = d["u__x__x"] + jnp.pi**2 * jnp.sin(jnp.pi * batch["x"])
        ub = jax.vmap(lambda x: model.apply(p, x))(jnp.array([[0.0], [1.0]]))  # no derivatives: no engine
        pde, bc = jnp.mean(r**2), jnp.mean(ub**2)
        return pde + bc, {"pde": pde, "bc": bc}

    opt = optax.adam(1e-3)
    state = jaxamp.TrainState.create(params=params, optimizer=opt, amp=amp, engines=[engine])
    return state, jaxamp.make_train_step(loss_fn, opt, amp=amp)


_RUNNERS: Dict[Any, Any] = {}


def runner(dtype: str, n_devices: int):
    """``(initial replicated state, data-parallel step, mesh)``, built once per (dtype, n) so
    that every use shares one compilation (compiling the step dominates this script's time)."""
    if (dtype, n_devices) not in _RUNNERS:
        state, step = build(dtype)
        mesh = parallel.make_mesh(n_devices)
        _RUNNERS[dtype, n_devices] = (parallel.replicate(state, mesh), parallel.data_parallel_step(step, mesh), mesh)
    return _RUNNERS[dtype, n_devices]


def points(nan_at=None, overflow_at=None) -> Dict[str, np.ndarray]:
    """The global batch: collocation points, NaN at index ``nan_at``, the overflow flag set at
    index ``overflow_at``."""
    x = np.linspace(0.0, 1.0, GLOBAL_BATCH, dtype=np.float32)
    overflow = np.zeros(GLOBAL_BATCH, bool)
    if nan_at is not None:
        x[nan_at] = np.nan
    if overflow_at is not None:
        overflow[overflow_at] = True
    return {"x": x, "overflow": overflow}


def trajectory(dtype: str, n_devices: int, steps: int) -> Dict[str, List[Any]]:
    """Per-step metrics of a run on a mesh of ``n_devices``."""
    state, run, mesh = runner(dtype, n_devices)
    prep = lambda b: parallel.shard_batch(b, mesh)  # noqa: E731
    clean, nan, overflow = prep(points()), prep(points(nan_at=BAD_INDEX)), prep(points(overflow_at=BAD_INDEX))
    out: Dict[str, List[Any]] = {}
    for i in range(steps):
        injected = dtype == "float16" and (nan if i in NAN_STEPS else overflow if i in OVERFLOW_STEPS else None)
        state, metrics = run(state, injected or clean)
        for k, v in metrics.items():
            out.setdefault(k, []).append(float(v))
    out["replicas_identical"] = [bool(parallel.replicas_identical(state))]
    return out


def same_bits(a: Any, b: Any) -> bool:
    """Every addressable shard of every leaf of ``a`` equals the same-device shard of ``b``."""
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        ys = {s.device: np.asarray(s.data) for s in y.addressable_shards}
        for s in x.addressable_shards:
            if np.asarray(s.data).tobytes() != ys[s.device].tobytes():
                return False
    return True


def inject() -> Dict[str, Any]:
    """On 8 devices: K clean steps, then a step with a NaN point and one with an overflow flag,
    each only in device ``BAD_DEVICE``'s shard, each followed by a clean step."""
    state, run, mesh = runner("float16", 8)
    clean = parallel.shard_batch(points(), mesh)
    for _ in range(K):
        state, _ = run(state, clean)
    order = list(mesh.devices.flat)
    bad_at = BAD_DEVICE * (GLOBAL_BATCH // 8) + 3
    scales = lambda s: {k: [float(v.scale), int(v.growth_tracker)]  # noqa: E731
                        for k, v in s.amp_state.derivative.items()}
    out: Dict[str, Any] = {}
    for name, batch in (("nan", points(nan_at=bad_at)), ("overflow", points(overflow_at=bad_at))):
        bad = parallel.shard_batch(batch, mesh)
        marked = lambda a: bool(np.isnan(a).any() if a.dtype.kind == "f" else a.any())  # noqa: E731
        new, metrics = run(state, bad)
        after, metrics2 = run(new, clean)
        out[name] = {
            "bad_devices": [order.index(s.device) for s in bad["x" if name == "nan" else "overflow"].addressable_shards
                            if marked(np.asarray(s.data))],
            "skipped": bool(metrics["skipped"]),
            "skip_reason": int(metrics["skip_reason"]),
            "found_inf": {k[len("found_inf/"):]: bool(v) for k, v in metrics.items() if k.startswith("found_inf/")},
            "found_nonfinite_values": bool(metrics["found_nonfinite_values"]),
            "params_unchanged": same_bits(new.params, state.params),
            "opt_state_unchanged": same_bits(new.opt_state.inner, state.opt_state.inner),
            "loss_scale_unchanged": same_bits(new.amp_state.loss, state.amp_state.loss),
            "replicas_identical_after_skip": parallel.replicas_identical(new),
            "deriv_scales_before": scales(state),
            "deriv_scales_after": scales(new),
            # what each scaler's own rule gives for a clean step from the state before
            "deriv_scales_clean_update": {
                k: [float(u.scale), int(u.growth_tracker)]
                for k, v in state.amp_state.derivative.items()
                for u in [amp_config("float16").derivative_scaler_for(k).update(jax.device_get(v), False)]
            },
            "deriv_scale_replicas": {
                k: [float(np.asarray(s.data)) for s in v.scale.addressable_shards]
                for k, v in new.amp_state.derivative.items()
            },
            "next_step_skipped": bool(metrics2["skipped"]),
            "replicas_identical_after_next": parallel.replicas_identical(after),
            "params_changed_after_next": not same_bits(after.params, new.params),
        }
        state = after
    return out


def hlo() -> Dict[str, Any]:
    state, run, mesh = runner("float16", 8)
    batch = parallel.shard_batch(points(), mesh)
    text = run.jitted.lower(state, batch).compile().as_text()  # cached: no second compilation
    ops = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
    # Result type of every all-reduce, e.g. "pred[]" (the overflow flags) or "f32[16,1]".
    types = re.findall(r"= (\(.*?\)|\S+) all-reduce\(", text)
    return {"counts": {op: text.count(f" {op}(") for op in ops}, "all_reduce_types": types}


def errors() -> Dict[str, str]:
    """The messages of the batch-size checks on 8 devices (raised before any compilation)."""
    out = {}
    mesh = parallel.make_mesh(8)
    try:
        parallel.shard_batch({"x": np.zeros(63, np.float32)}, mesh)
    except ValueError as e:
        out["shard_batch"] = str(e)
    run = parallel.data_parallel_step(lambda s, b: (s, {}), mesh)
    try:
        run({}, {"x": np.zeros(60, np.float32)})
    except ValueError as e:
        out["data_parallel_step"] = str(e)
    try:
        parallel.make_mesh(9)
    except ValueError as e:
        out["make_mesh"] = str(e)
    return out


def multihost(process_id: int, port: int) -> Dict[str, Any]:
    """One of 2 processes (2 fake CPU devices each) of a multi-host run over localhost.

    Each process passes only its half of a 16-point batch to shard_batch; a tiny step skips
    its update when any point of the *global* batch is NaN (the same jnp.any pattern as the
    derivative engine's flags). Step 2 has a NaN only in process 1's half.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    mesh = parallel.make_mesh()

    def step(state, batch):
        bad = jnp.any(jnp.isnan(batch["x"]))
        return jnp.where(bad, state, state + jnp.mean(batch["x"])), {"skipped": bad}

    run = parallel.data_parallel_step(step, mesh)
    state = parallel.replicate(jnp.float32(2.0), mesh)
    out: Dict[str, Any] = {"process_count": jax.process_count(), "device_count": jax.device_count()}
    for i in range(2):
        x = np.arange(16, dtype=np.float32)[8 * process_id: 8 * process_id + 8]
        if i == 1 and process_id == 1:
            x[2] = np.nan
        batch = parallel.shard_batch({"x": x}, mesh)
        out["global_batch_shape"] = list(batch["x"].shape)
        state, m = run(state, batch)
        out[f"step{i}"] = {
            "skipped": bool(np.asarray(m["skipped"].addressable_shards[0].data)),
            "state": [float(np.asarray(sh.data)) for sh in state.addressable_shards],
        }
    jax.distributed.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--part", choices=("fp32", "fp16", "all"), default="all")
    ap.add_argument("--devices", default="1,2,8", help="mesh sizes of the trajectories, e.g. 1,8 or 2")
    ap.add_argument("--multihost", type=int, metavar="PROCESS_ID", help="run one process of the 2-process check")
    ap.add_argument("--port", type=int, default=0, help="coordinator port for --multihost")
    args = ap.parse_args()
    if args.multihost is not None:
        print(json.dumps(multihost(args.multihost, args.port)))
        return
    if jax.device_count() < 8:
        sys.exit(f"parallel_worker.py: needs 8 devices, JAX sees {jax.device_count()}.")
    sizes = [int(n) for n in args.devices.split(",")]
    result: Dict[str, Any] = {"device_count": jax.device_count(), "steps": args.steps}
    with jax.default_matmul_precision("highest"):
        if args.part in ("fp32", "all"):
            result["float32"] = {str(n): trajectory("float32", n, args.steps) for n in sizes}
            result["errors"] = errors()
        if args.part in ("fp16", "all"):
            result["float16"] = {str(n): trajectory("float16", n, args.steps) for n in sizes}
            if 8 in sizes:  # the 8-device step is compiled already
                result["inject"] = inject()
                result["hlo"] = hlo()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
