"""Data-parallel training: meshes, sharded batches, one global skip decision.

Public names of :mod:`jaxamp._src.training.parallel` (the implementation).
"""

from jaxamp._src.training.parallel import (  # noqa: F401
    BATCH_AXIS, make_mesh, batch_sharding, replicated_sharding, shard_batch, replicate,
    data_parallel_step, replicas_identical,
)

__all__ = [
    'BATCH_AXIS', 'make_mesh', 'batch_sharding', 'replicated_sharding', 'shard_batch', 'replicate',
    'data_parallel_step', 'replicas_identical',
]
