"""Data-parallel training over a device mesh, with one global skip decision.

The batch is split along a ``"batch"`` mesh axis; parameters, optimizer state and scaler states
are replicated. The step of :func:`jaxamp.make_train_step` is jitted unchanged with those
shardings, and GSPMD turns every reduction over the batch (overflow flags, loss, gradients) into
an all-reduce, so an overflow on any shard skips the step on every device alike. This is exact
for any loss, also one that is not a mean over points (unlike ``shard_map`` with ``pmean``).

One API for one device (``make_mesh(1)``) and many::

    mesh = jaxamp.parallel.make_mesh()            # all devices; make_mesh(2): the first two
    state = jaxamp._src.training.parallel.replicate(state, mesh)
    step = jaxamp.parallel.data_parallel_step(jaxamp.make_train_step(loss_fn, opt, amp=amp), mesh)
    state, metrics = step(state, jaxamp.parallel.shard_batch({"x": x}, mesh))

The global batch size must be divisible by the number of devices on the batch axis. Multi-host:
call ``jax.distributed.initialize()`` *before any other JAX call* in every process (on CPU, with
``jax_cpu_collectives_implementation="gloo"``) and run the same program everywhere: each process
passes *its own part* of the global batch to :func:`shard_batch` and the same state to
:func:`replicate`. Tested on fake CPU devices and 2 local processes (tests/test_multihost.py:
skip decisions and scales equal the 1-process run's bit for bit; params agree to rounding, as
the float16 gradient all-reduce sums in another order), not on multi-node GPUs. The recipe,
and what ``pmap`` users do: docs/parallel.md.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple, TypeVar, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

BATCH_AXIS = "batch"
T = TypeVar("T")


def make_mesh(devices: Union[None, int, Sequence[jax.Device]] = None, *, axis_name: str = BATCH_AXIS) -> Mesh:
    """A one-axis mesh for data parallelism.

    Args:
      devices: ``None``: every device of every process (``jax.devices()``); an ``int`` n:
        the first n of ``jax.devices()``; or an explicit sequence of devices.
      axis_name: the mesh axis the batch is split along.
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"make_mesh: `axis_name`={axis_name!r} must be a non-empty string.")
    available = jax.devices()
    if devices is None:
        chosen = list(available)
    elif isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if not 1 <= int(devices) <= len(available):
            raise ValueError(f"make_mesh: `devices`={int(devices)} must be between 1 and the {len(available)} "
                             f"available device(s) ({available[0].platform}). On CPU, fake more with "
                             "XLA_FLAGS=--xla_force_host_platform_device_count=N set before JAX starts.")
        chosen = list(available[: int(devices)])
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        chosen = list(devices)
        if not chosen or not all(isinstance(d, jax.Device) for d in chosen):
            raise ValueError(f"make_mesh: `devices`={devices!r} must be None, a positive int or a non-empty "
                             "sequence of jax.Device.")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"make_mesh: `devices`={devices!r} lists a device more than once.")
    else:
        raise TypeError(f"make_mesh: `devices`={devices!r} must be None, a positive int or a sequence of jax.Device.")
    return Mesh(np.array(chosen, dtype=object), (axis_name,))


def _check_mesh(fn: str, mesh: Any) -> str:
    """The mesh's single (batch) axis name; raises on anything but a one-axis Mesh."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{fn}: `mesh`={mesh!r} must be a jax.sharding.Mesh (see make_mesh).")
    if len(mesh.axis_names) != 1:
        raise ValueError(f"{fn}: `mesh` has axes {mesh.axis_names}; data parallelism here needs a one-axis mesh "
                         "(make_mesh builds one).")
    return mesh.axis_names[0]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading dimension split over the mesh's batch axis: ``NamedSharding(mesh, P(axis))``."""
    return NamedSharding(mesh, PartitionSpec(_check_mesh("batch_sharding", mesh)))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of ``mesh``: ``NamedSharding(mesh, P())``."""
    _check_mesh("replicated_sharding", mesh)
    return NamedSharding(mesh, PartitionSpec())


def _check_divisible(fn: str, batch: Any, n_parts: int, what: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = np.shape(leaf)
        name = jax.tree_util.keystr(path) or "<root>"
        if len(shape) == 0:
            raise ValueError(f"{fn}: batch leaf {name} is a scalar; every leaf of a sharded batch needs a leading "
                             "batch dimension (put constants in the loss function or replicate them).")
        if shape[0] % n_parts:
            raise ValueError(f"{fn}: batch leaf {name} has {what} batch size {shape[0]} (shape {shape}), which is not "
                             f"divisible by the {n_parts} device(s) of the batch axis; use a multiple of {n_parts}.")


def shard_batch(batch: T, mesh: Mesh) -> T:
    """Split every leaf of ``batch`` along its leading dimension over the mesh's batch axis.

    Multi-host, each process passes its own part (concatenated in process order). Every leaf's
    leading size must be divisible by the number of (local) devices on the axis.
    """
    sharding = batch_sharding(mesh)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    _check_divisible("shard_batch", batch, len(local), "global" if jax.process_count() == 1 else "local")
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def replicate(tree: T, mesh: Mesh) -> T:
    """A full copy of every leaf of ``tree`` on every device of ``mesh`` (every process must
    pass the same values)."""
    sharding = replicated_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)


def data_parallel_step(step: Callable[[Any, Any], Tuple[Any, Any]], mesh: Mesh, *, batch_spec: Any = None,
                       **jit_kwargs: Any) -> Callable[[Any, Any], Tuple[Any, Any]]:
    """Jit ``step(state, batch) -> (state, metrics)`` to run data-parallel over ``mesh``.

    Args:
      step: the pure step from :func:`jaxamp.make_train_step` (or any function of that shape).
      mesh: a one-axis mesh (:func:`make_mesh`); one device works the same way.
      batch_spec: a ``PartitionSpec`` or a pytree prefix of them for the batch. Default:
        every leaf split along its leading dimension (``P(axis)``). Use ``P()`` for parts
        that every device needs whole, e.g. ``{"interior": P("batch"), "boundary": P()}``.
      **jit_kwargs: passed to ``jax.jit`` (e.g. ``compiler_options``, ``donate_argnums``).

    Returns ``run(state, batch)``, whose state and metrics come back replicated; inputs are moved
    to their shardings as needed and batch sizes are checked before anything is compiled.
    """
    if not callable(step):
        raise TypeError(f"data_parallel_step: `step`={step!r} must be callable.")
    axis = _check_mesh("data_parallel_step", mesh)
    for key in ("in_shardings", "out_shardings"):
        if key in jit_kwargs:
            raise ValueError(f"data_parallel_step: `{key}` is set by data_parallel_step; do not pass it.")
    if batch_spec is None:
        batch_spec = PartitionSpec(axis)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    for spec in jax.tree_util.tree_leaves(batch_spec, is_leaf=is_spec):
        if not is_spec(spec) or any(a not in (None, axis) for a in spec):
            raise ValueError(f"data_parallel_step: `batch_spec` leaf {spec!r} must be a PartitionSpec using only "
                             f"the mesh axis {axis!r} (e.g. P({axis!r}) or P()).")
    batch_shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), batch_spec, is_leaf=is_spec)
    replicated = replicated_sharding(mesh)
    jitted = jax.jit(step, in_shardings=(replicated, batch_shardings), out_shardings=(replicated, replicated),
                     **jit_kwargs)
    n_parts = mesh.shape[axis]

    def check(spec: PartitionSpec, sub: Any) -> None:
        if len(spec) and spec[0] == axis:
            _check_divisible("data_parallel_step", sub, n_parts, "global")

    def run(state: Any, batch: Any) -> Tuple[Any, Any]:
        jax.tree_util.tree_map(check, batch_spec, batch, is_leaf=is_spec)
        return jitted(state, batch)

    run.jitted = jitted  # type: ignore[attr-defined]  # for .lower(...) / HLO inspection
    run.mesh = mesh  # type: ignore[attr-defined]
    return run


def replicas_identical(tree: Any) -> bool:
    """True when every addressable shard of every (replicated) leaf holds bit-identical data
    (NaNs compare equal to themselves)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        ref = (shards[0].shape, shards[0].dtype, shards[0].tobytes())
        if any((o.shape, o.dtype, o.tobytes()) != ref for o in shards[1:]):
            return False
    return True


__all__ = ["BATCH_AXIS", "make_mesh", "batch_sharding", "replicated_sharding", "shard_batch", "replicate",
           "data_parallel_step", "replicas_identical"]
