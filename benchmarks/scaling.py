"""Data-parallel scaling of the jaxamp train step; prints one JSON object.

    python benchmarks/scaling.py [--devices 1,2,4,8] [--global-batch 4096] [--dtype float16]

Times one mixed-precision PINN train step (1D Poisson, FullyConnected, second derivatives
through the derivative engine) under :func:`jaxamp.parallel.data_parallel_step` on meshes
of several sizes:

- strong scaling: the same global batch on every mesh; speedup(n) = t(1) / t(n),
  efficiency(n) = t(1) / (n * t(n));
- weak scaling: ``global_batch / max(devices)`` points per device; efficiency(n) = t(1) / t(n).

Compilation is excluded; each time is the median over ``--repeats`` of ``--steps`` steps.
On a machine without accelerators the script fakes ``--fake-cpu-devices`` CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count) *before* JAX starts. Those devices share
the host's few cores, so their "scaling" measures partitioning and collective overhead,
not parallel speed-up; the JSON says so (``fake_devices``, ``host_cpu_cores``, ``note``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="1,2,4,8", help="comma-separated mesh sizes (default 1,2,4,8)")
    ap.add_argument("--global-batch", type=int, default=4096, help="collocation points per step")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--layer-size", type=int, default=64)
    ap.add_argument("--nr-layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fake-cpu-devices", type=int, default=8, help="CPU devices to fake when JAX runs on CPU")
    ap.add_argument("--mode", default="both", choices=("strong", "weak", "both"))
    args = ap.parse_args()
    try:
        args.devices = sorted({int(d) for d in args.devices.split(",")})
    except ValueError:
        ap.error(f"--devices={args.devices!r} must be comma-separated positive integers, e.g. 1,2,4,8")
    if args.devices[0] < 1:
        ap.error(f"--devices={args.devices} must all be >= 1")
    for name in ("global_batch", "layer_size", "nr_layers", "steps", "repeats", "fake_cpu_devices"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    bad = [n for n in args.devices if args.global_batch % n]
    if bad:
        ap.error(f"--global-batch={args.global_batch} must be divisible by every mesh size in "
                 f"--devices; it is not by {bad}")
    return args


def main() -> None:
    args = parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # must precede `import jax`
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.fake_cpu_devices}".strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxamp
    from jaxamp._src.training import parallel
    from jaxamp.models import FullyConnected

    available = len(jax.devices())
    if args.devices[-1] > available:
        sys.exit(f"scaling.py: --devices asks for {args.devices[-1]} devices, JAX sees {available}.")

    amp = jaxamp.AmpConfig(dtype=args.dtype)
    model = FullyConnected.from_amp(amp, out_features=1, layer_size=args.layer_size, nr_layers=args.nr_layers)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(1))
    engine = jaxamp.Derivatives(
        lambda p, x: model.apply(p, x), inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=amp
    )

    def loss_fn(p, batch):
        d = engine(p, {"x": batch["x"]})
        r = d["u__x__x"] + jnp.pi**2 * jnp.sin(jnp.pi * batch["x"])
        ub = jax.vmap(lambda x: model.apply(p, x))(jnp.array([[0.0], [1.0]]))
        pde, bc = jnp.mean(r**2), jnp.mean(ub**2)
        return pde + bc, {"pde": pde, "bc": bc}

    opt = optax.adam(1e-3)
    state0 = jaxamp.TrainState.create(params=params, optimizer=opt, amp=amp, engines=[engine])
    step = jaxamp.make_train_step(loss_fn, opt, amp=amp)
    rng = np.random.default_rng(0)

    def time_step(n: int, batch_size: int) -> float:
        mesh = parallel.make_mesh(n)
        run = runs.setdefault(n, parallel.data_parallel_step(step, mesh))
        state = parallel.replicate(state0, mesh)
        batch = parallel.shard_batch({"x": rng.uniform(0, 1, batch_size).astype(np.float32)}, mesh)
        state, m = run(state, batch)  # compile + warm up
        jax.block_until_ready((state, m))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = run(state, batch)
            jax.block_until_ready((state, m))
            times.append((time.perf_counter() - t0) / args.steps)
        return statistics.median(times)

    runs: dict = {}
    platform = jax.devices()[0].platform
    result = {
        "benchmark": "jaxamp.parallel data-parallel train step",
        "platform": platform,
        "device_kind": jax.devices()[0].device_kind,
        "devices_available": available,
        "fake_devices": platform == "cpu" and available > 1,
        "host_cpu_cores": os.cpu_count(),
        "dtype": args.dtype,
        "model": f"FullyConnected {args.nr_layers}x{args.layer_size}, 1D Poisson, u__x__x",
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "jax_version": jax.__version__,
    }
    if result["fake_devices"]:
        result["note"] = (
            f"{available} fake CPU devices (--xla_force_host_platform_device_count) share "
            f"{os.cpu_count()} host CPU core(s): efficiency here reflects partitioning and "
            "collective overhead, not real multi-device speed-up."
        )
    if args.mode in ("strong", "both"):
        t = {n: time_step(n, args.global_batch) for n in args.devices}
        result["strong"] = {
            "global_batch": args.global_batch,
            "step_ms": {str(n): round(1e3 * v, 3) for n, v in t.items()},
            "speedup": {str(n): round(t[args.devices[0]] / v, 3) for n, v in t.items()},
            "efficiency": {str(n): round(t[args.devices[0]] * args.devices[0] / (n * v), 3) for n, v in t.items()},
        }
    if args.mode in ("weak", "both"):
        per = args.global_batch // args.devices[-1]
        t = {n: time_step(n, per * n) for n in args.devices}
        result["weak"] = {
            "per_device_batch": per,
            "step_ms": {str(n): round(1e3 * v, 3) for n, v in t.items()},
            "efficiency": {str(n): round(t[args.devices[0]] / v, 3) for n, v in t.items()},
        }
    if hasattr(os, "getloadavg"):  # other work on the host skews CPU timings: record it
        result["host_load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
