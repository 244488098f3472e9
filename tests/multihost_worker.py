"""A float16 PINN trained data-parallel over a global mesh, run by tests/test_multihost.py.

One program, run either as one process with 8 fake CPU devices or as 2 processes with 4 fake
CPU devices each, joined by ``jax.distributed.initialize`` on the loopback address::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/multihost_worker.py
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python tests/multihost_worker.py --process-id 0 --num-processes 2 --port P   # and --process-id 1

The problem: ``u'' = -pi^2 sin(pi x)`` on [0, 1] for ``u = x (1 - x) N(x)`` (a hard Dirichlet
ansatz), ``N`` a small tanh MLP under :func:`jaxamp.autocast`, ``u''`` by nested
:func:`jaxamp.grad` under ``vmap``. Every step's global batch of ``GLOBAL_BATCH`` points is the
same in every run; each process builds only *its own part* of it (process ``p`` holds points
``[p * n, (p + 1) * n)``, n = GLOBAL_BATCH / processes) and the mesh splits it over the 8
devices (``jax.make_array_from_process_local_data``, via ``jaxamp.parallel.shard_batch``).
Two steps carry an injected fault at global point ``BAD_INDEX``, which lies in process 1's part
(mesh device ``BAD_INDEX // 8`` = 5), so in the 2-process run only process 1 ever sees it:

- ``HUGE_STEP``: x = ``HUGE_X`` (finite): the float16 backward overflows (non-finite weight
  gradients, the loss scale backs off);
- ``INF_STEP``: x = inf: bad values (no scaler moves).

The derivative scalers start at ``2**DERIV_INIT_LOG2`` and grow every ``GROWTH`` clean steps,
so the run also overflows derivatives (and backs off) without injection.

Both user paths run, each ``STEPS`` steps from the same start: the README's
(``jaxamp.value_and_grad`` + ``jaxamp.optimizer`` + ``optax.apply_updates`` under one
``jax.jit`` with explicit shardings) and ``jaxamp.make_train_step`` under
``jaxamp.parallel.data_parallel_step``. The last stdout line is one JSON object of raw
measurements (arrays as the hex of their bytes, so equal means bit-for-bit equal); the test
asserts.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import sys
from typing import Any, Dict, List

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    sys.exit("multihost_worker.py: set XLA_FLAGS=--xla_force_host_platform_device_count=N "
             "(8 for one process, 4 for each of 2 processes).")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

N_DEVICES = 8
GLOBAL_BATCH = 64  # 8 points per device
STEPS = 14
HUGE_STEP, HUGE_X = 3, 1.0e4
INF_STEP = 7
BAD_INDEX = 45  # process 1's part (points 32..63), mesh device 5 (points 40..47)
DERIV_INIT_LOG2, DERIV_MAX_LOG2, GROWTH = 9, 14, 2
SIZES = (1, 16, 16, 1)


def pin_gloo_to_loopback() -> bool:
    """Make JAX's gloo CPU collectives bind to 127.0.0.1 (by default they use the address of
    the machine's hostname). Patches the factory JAX calls when it creates the CPU backend;
    returns False where this JAX has no such factory (the test then fails, naming it)."""
    from jax._src import xla_bridge

    make = getattr(getattr(xla_bridge, "_jax", None), "make_gloo_tcp_collectives", None)
    if make is None:
        return False
    xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(make, hostname="127.0.0.1")
    return True


def amp_config():
    import jaxamp

    return jaxamp.AmpConfig(
        dtype="float16", autocast_firstlayer=True,
        default_max_scale_log2=DERIV_MAX_LOG2,
        custom_init_scales_log2={"1": DERIV_INIT_LOG2, "2": DERIV_INIT_LOG2},
        derivative_scaler={"growth_interval": GROWTH, "recover_growth_interval": GROWTH},
        loss_scaler={"init_scale": 2.0**4, "growth_interval": 3, "recover_growth_interval": 2},
    )


def init_params(key):
    return [(jax.random.normal(jax.random.fold_in(key, i), (m, n)) * np.float32(1.0 / np.sqrt(m)), jnp.zeros(n))
            for i, (m, n) in enumerate(zip(SIZES[:-1], SIZES[1:]))]


def mlp(params, x):
    h = jnp.reshape(x, (1,))
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    return (h @ w + b)[0]


def pinn(amp):
    """``per_point(params, batch) -> (r2, ux2)``: each point's squared residual and ``u'^2``
    (a small first-derivative term, so that key "1" guards a derivative the loss uses)."""
    import jaxamp

    def u_net(p, x):
        return jaxamp.autocast(lambda p, x: x * (1.0 - x) * mlp(p, x), amp)(p, x)

    def per_point(p, batch):
        x = batch["x"]
        u_xx = jax.vmap(jaxamp.grad(jaxamp.grad(u_net, 1), 1), (None, 0))(p, x)
        u_x = jax.vmap(jaxamp.grad(u_net, 1), (None, 0))(p, x)
        return (u_xx + jnp.pi**2 * jnp.sin(jnp.pi * x)) ** 2, u_x**2

    return per_point


def global_batch(step: int) -> Dict[str, np.ndarray]:
    """The step's global batch (the same in every process and every run), faults injected."""
    x = np.random.default_rng(step).uniform(0.0, 1.0, GLOBAL_BATCH).astype(np.float32)
    if step == HUGE_STEP:
        x[BAD_INDEX] = HUGE_X
    if step == INF_STEP:
        x[BAD_INDEX] = np.inf
    return {"x": x}


def bits(a: Any) -> str:
    """The hex of the bytes of one (replicated) array, read from this process's first shard."""
    if hasattr(a, "addressable_shards"):
        a = a.addressable_shards[0].data
    return np.ascontiguousarray(np.asarray(a)).tobytes().hex()


def digest(tree: Any) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(bits(leaf).encode())
    return h.hexdigest()


def amp_bits(tree: Any) -> Dict[str, str]:
    """Every leaf of the one AmpState in ``tree`` (each scaler's scale, trackers, ...), by path."""
    import jaxamp

    found = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, jaxamp.AmpState))
             if isinstance(x, jaxamp.AmpState)]
    assert len(found) == 1, f"expected one AmpState in the state, found {len(found)}"
    return {jax.tree_util.keystr(p): bits(v) for p, v in jax.tree_util.tree_flatten_with_path(found[0])[0]}


def amp_scales(tree: Any) -> Dict[str, float]:
    """The readable log2 scales, for messages."""
    import jaxamp

    st = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, jaxamp.AmpState))
          if isinstance(x, jaxamp.AmpState)][0]
    out = {k: float(np.log2(np.asarray(v.addressable_shards[0].data))) for k, v in st.scales.items()}
    out["loss"] = float(np.log2(np.asarray(st.loss_scale.addressable_shards[0].data)))
    return out


def run(args) -> Dict[str, Any]:
    import jaxamp
    from jaxamp._src.training import parallel

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    out: Dict[str, Any] = {"jax": jax.__version__}
    if args.num_processes > 1:
        out["gloo_on_loopback"] = pin_gloo_to_loopback()
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                                   process_id=args.process_id, local_device_ids=None,
                                   initialization_timeout=args.timeout)
    pid, nproc = jax.process_index(), jax.process_count()
    out.update(process_index=pid, process_count=nproc, device_count=jax.device_count(),
               local_device_count=jax.local_device_count(), platform=jax.devices()[0].platform)
    mesh = parallel.make_mesh()
    order = list(mesh.devices.flat)
    n_local = GLOBAL_BATCH // nproc
    lo = pid * n_local

    def local_batch(step):  # this process's part of the global batch: all that it ever holds
        return {k: v[lo: lo + n_local] for k, v in global_batch(step).items()}

    amp = amp_config()
    per_point = pinn(amp)

    def loss_terms(p, batch):
        r2, ux2 = per_point(p, batch)
        pde, reg = jnp.mean(r2), 1e-3 * jnp.mean(ux2)
        return pde + reg, {"pde": pde, "reg": reg}

    def loss_fn(p, batch):
        return loss_terms(p, batch)[0]

    params0 = init_params(jax.random.PRNGKey(0))
    out["params0"] = [bits(x) for x in jax.tree_util.tree_leaves(params0)]
    # The same start in every process: a profile of the loss on the whole first batch (local
    # numpy, no collective), as the single-process run does.
    amp_state = jaxamp.init(loss_fn, amp)(params0, global_batch(0))
    out["init_scales"] = {k: float(v) for k, v in amp_state.scales.items()}

    # Where each mesh position's points come from (the global index range of every shard).
    probe = parallel.shard_batch(local_batch(0), mesh)["x"]
    out["global_shape"] = list(probe.shape)
    out["local_shards"] = sorted([order.index(s.device), s.index[0].start, s.index[0].stop]
                                 for s in probe.addressable_shards)
    out["local_bad"] = {}
    for step in (HUGE_STEP, INF_STEP):
        b = parallel.shard_batch(local_batch(step), mesh)["x"]
        marked = lambda a: bool((~np.isfinite(a)).any() or (np.abs(a) > 1.0).any())  # noqa: E731
        out["local_bad"][str(step)] = sorted(order.index(s.device) for s in b.addressable_shards
                                             if marked(np.asarray(s.data)))

    # ---- the README's user path: value_and_grad + jaxamp.optimizer, jit over sharded arrays ----
    optimizer = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state)
    rep, by_batch = parallel.replicated_sharding(mesh), parallel.batch_sharding(mesh)

    @functools.partial(jax.jit, in_shardings=(rep, rep, by_batch), out_shardings=rep)
    def user_step(params, opt_state, batch):
        loss, grads, flags = jaxamp.value_and_grad(loss_fn)(opt_state, params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params, flags=flags)
        return optax.apply_updates(params, updates), opt_state, loss, flags.found_inf

    params = parallel.replicate(params0, mesh)
    opt_state = parallel.replicate(optimizer.init(params0), mesh)
    user: List[Dict[str, Any]] = []
    for step in range(STEPS):
        new_params, opt_state, loss, found = user_step(params, opt_state, parallel.shard_batch(local_batch(step), mesh))
        user.append({
            "applied": digest(new_params) != digest(params),
            "skip_reason": bits(opt_state.skip_reason) if hasattr(opt_state, "skip_reason") else None,
            "found_inf": {k: bool(np.asarray(v.addressable_shards[0].data)) for k, v in found.items()},
            "loss": bits(loss), "params": digest(new_params), "opt_state": digest(opt_state),
            "amp": amp_bits(opt_state), "scales_log2": amp_scales(opt_state),
            "replicas_identical": parallel.replicas_identical((new_params, opt_state, loss)),
        })
        params = new_params
    out["user"] = user
    out["user_final_params"] = [bits(x) for x in jax.tree_util.tree_leaves(params)]

    # ---- make_train_step under data_parallel_step ----
    opt = optax.adam(1e-3)
    state0 = jaxamp.TrainState.create(params=params0, optimizer=opt, amp=amp, amp_state=amp_state)
    train_step = parallel.data_parallel_step(jaxamp.make_train_step(loss_terms, opt, amp=amp), mesh)
    state = parallel.replicate(state0, mesh)
    trained: List[Dict[str, Any]] = []
    for step in range(STEPS):
        state, metrics = train_step(state, parallel.shard_batch(local_batch(step), mesh))
        m = {k: np.asarray(v.addressable_shards[0].data) for k, v in metrics.items()}
        trained.append({
            "skipped": bool(m["skipped"]), "skip_reason": int(m["skip_reason"]),
            "metrics": {k: bits(v) for k, v in m.items()},
            "params": digest(state.params), "opt_state": digest(state.opt_state),
            "amp": amp_bits(state.amp_state), "scales_log2": amp_scales(state.amp_state),
            "replicas_identical": parallel.replicas_identical(state),
        })
    out["train_step"] = trained
    out["train_final_params"] = [bits(x) for x in jax.tree_util.tree_leaves(state.params)]
    if nproc > 1:
        jax.distributed.shutdown()
    return out


PMAP_STEPS = 40
PMAP_VARIANTS = {
    # name: (per-device loss, reduction of the weight gradients over the pmap axis)
    "pmap_local_mean_pmean": ("local_mean", "pmean"),
    "pmap_global_sum_psum": ("sum_over_global_count", "psum"),
    "pmap_local_mean_no_reduction": ("local_mean", None),
}


def pmap_compare(steps: int) -> Dict[str, Any]:
    """One process, 8 devices: the sharded-jit user step against ``jax.pmap`` user steps.

    ``jaxamp.optimizer(..., axis_name="batch")`` ORs the flags over the pmap axis in every
    variant; they differ in the per-device loss (the mean over the device's points, or its sum
    divided by the global batch size) and in what reduces the weight gradients (``pmean``,
    ``psum`` or nothing). Per step: applied, the skip reason, every scale (log2) of device 0,
    and whether all 8 replicas of the params are bit-identical.
    """
    import jaxamp
    from jaxamp._src.training import parallel

    n = jax.device_count()
    amp = amp_config()
    per_point = pinn(amp)

    def global_loss(p, b):
        r2, ux2 = per_point(p, b)
        return jnp.mean(r2) + 1e-3 * jnp.mean(ux2)

    params0 = init_params(jax.random.PRNGKey(0))
    amp_state = jaxamp.init(global_loss, amp)(params0, global_batch(0))
    out: Dict[str, Any] = {"device_count": n, "steps": steps, "jax": jax.__version__}

    def row(before, after, opt_state, take=lambda a: a):
        reason = getattr(opt_state, "skip_reason", None)
        return {"applied": digest(jax.tree_util.tree_map(take, after)) != digest(jax.tree_util.tree_map(take, before)),
                "skip_reason": None if reason is None else int(np.asarray(take(reason))),
                "scales_log2": {k: float(np.log2(np.asarray(take(v)))) for k, v in
                                {**find_amp(opt_state).scales, "loss": find_amp(opt_state).loss_scale}.items()}}

    # the references: jit over the batch sharded over all devices, and over one device
    optimizer = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state)
    for name, n_mesh in (("jit", n), ("jit_1_device", 1)):
        mesh = parallel.make_mesh(n_mesh)
        rep, by_batch = parallel.replicated_sharding(mesh), parallel.batch_sharding(mesh)

        @functools.partial(jax.jit, in_shardings=(rep, rep, by_batch), out_shardings=rep)
        def jit_step(params, opt_state, batch):
            loss, grads, flags = jaxamp.value_and_grad(global_loss)(opt_state, params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params, flags=flags)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = parallel.replicate(params0, mesh), parallel.replicate(optimizer.init(params0), mesh)
        rows = []
        for step in range(steps):
            new, opt_state = jit_step(params, opt_state, parallel.shard_batch(global_batch(step), mesh))
            rows.append(row(params, new, opt_state, take=lambda a: a.addressable_shards[0].data))
            params = new
        out[name] = rows
        if n_mesh == n:  # what the compiled step all-reduces, by result type (e.g. pred[3], f16[16,16])
            text = jit_step.lower(params, opt_state, parallel.shard_batch(global_batch(0), mesh)).compile().as_text()
            out["jit_all_reduce_types"] = re.findall(r"= (\(.*?\)|\S+) all-reduce\(", text)

    stack = lambda tree: jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * n), tree)  # noqa: E731
    for name, (loss_kind, reduce) in PMAP_VARIANTS.items():
        def local_loss(p, b, loss_kind=loss_kind):
            r2, ux2 = per_point(p, b)
            if loss_kind == "local_mean":
                return jnp.mean(r2) + 1e-3 * jnp.mean(ux2)
            return (jnp.sum(r2) + 1e-3 * jnp.sum(ux2)) / GLOBAL_BATCH

        tx = jaxamp.optimizer(optax.adam(1e-3), amp_state=amp_state, axis_name="batch")

        def pmap_step(params, opt_state, batch, local_loss=local_loss, tx=tx, reduce=reduce):
            loss, grads, flags = jaxamp.value_and_grad(local_loss)(opt_state, params, batch)
            if reduce is not None:
                grads = getattr(jax.lax, reduce)(grads, "batch")
            updates, opt_state = tx.update(grads, opt_state, params, flags=flags)  # flags OR-ed over "batch"
            return optax.apply_updates(params, updates), opt_state

        run_pmap = jax.pmap(pmap_step, axis_name="batch")
        params, opt_state = stack(params0), stack(tx.init(params0))
        rows = []
        for step in range(steps):
            batch = {k: v.reshape(n, -1) for k, v in global_batch(step).items()}
            new, opt_state = run_pmap(params, opt_state, batch)
            r = row(params, new, opt_state, take=lambda a: np.asarray(a)[0])
            r["replicas_identical"] = all(len({np.asarray(a)[i].tobytes() for i in range(n)}) == 1
                                          for a in jax.tree_util.tree_leaves(new))
            rows.append(r)
            params = new
        out[name] = rows
    return out


def find_amp(tree: Any):
    import jaxamp

    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, jaxamp.AmpState))
            if isinstance(x, jaxamp.AmpState)][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--port", type=int, default=0, help="the coordinator's port on 127.0.0.1 (2 processes)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds to wait for the other process to join")
    ap.add_argument("--pmap", action="store_true", help="one process: sharded jit against jax.pmap user steps")
    args = ap.parse_args()
    if args.pmap:
        with jax.default_matmul_precision("highest"):
            print(json.dumps(pmap_compare(PMAP_STEPS)))
        return
    if args.num_processes not in (1, 2):
        sys.exit(f"multihost_worker.py: --num-processes={args.num_processes}; this check runs 1 or 2.")
    if args.num_processes == 2 and not 0 < args.port < 65536:
        sys.exit(f"multihost_worker.py: --port={args.port}; 2 processes need the coordinator's free port.")
    with jax.default_matmul_precision("highest"):
        result = run(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
