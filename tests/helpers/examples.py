"""Tiny configurations of the example problems, shared by the tests under tests/examples."""

import json

from examples.burgers import Burgers
from examples.common.config import load_config
from examples.helmholtz import Helmholtz
from examples.ldc import LDC

# Per-problem batch sizes and the settings common to all: a 2x8 net, a 9x9 evaluation grid,
# checkpoints every 2 steps, so that a run of a few steps exercises every code path.
TINY = {
    LDC: ["batch.top_wall=8", "batch.no_slip=8", "batch.interior=16", "eval.reference_n=17"],
    Burgers: ["batch.initial=8", "batch.boundary=8", "batch.interior=16"],
    Helmholtz: ["batch.boundary=8", "batch.interior=16", "model.frequencies=[axis,[0,1,2]]"],
}
COMMON = ["model.layer_size=8", "model.nr_layers=2", "eval.grid=9", "training.chunk_steps=2",
          "training.checkpoint_every=2"]


def tiny(cls, mode, steps):
    """The config of problem ``cls`` in ``mode`` for ``steps`` steps, at the tiny sizes above."""
    return load_config(cls.name, [*COMMON, *TINY[cls], f"mode={mode}", f"training.max_steps={steps}"],
                       checks=cls.checks)


def read(path):
    """The records of a JSONL file (metrics.jsonl)."""
    return [json.loads(line) for line in path.read_text().splitlines()]
