"""Data-parallel training: a mesh, the batch split over it, one global skip decision.

Public names of :mod:`jaxamp._src.training.parallel` (the implementation).
"""

from jaxamp._src.training.parallel import data_parallel_step, make_mesh, replicate, shard_batch

__all__ = ["make_mesh", "shard_batch", "replicate", "data_parallel_step"]
