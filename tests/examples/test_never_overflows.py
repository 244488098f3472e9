"""A DerivScaler that never acts costs nothing: on problems whose derivatives never overflow,
fp16 + DerivScaler (per order) trains to exactly plain fp16's result.

It follows from the one-graph property (tests/test_one_graph.py): with every derivative scale
1 the scaled train step is bit-identical to the unscaled one, and a scale only moves when a
key overflows (derivative scales never grow above 2^0 by default). Shown end to end on two
examples with an exact solution (Helmholtz, manufactured; Burgers, Cole-Hopf), XLA's default
flags, a few hundred steps: every loss of every step, and the final error, bit for bit.
"""

import pytest

from examples.burgers import Burgers
from examples.common.config import load_config
from examples.common.train import train_and_evaluate
from examples.helmholtz import Helmholtz
from tests.helpers.examples import TINY, read

STEPS = 300
SIZES = ["model.layer_size=32", "model.nr_layers=3", "eval.grid=17", f"training.chunk_steps={STEPS}",
         f"training.checkpoint_every={STEPS}", f"training.max_steps={STEPS}"]


@pytest.mark.slow
@pytest.mark.parametrize("cls", [Helmholtz, Burgers], ids=lambda c: c.name)
def test_scaler_that_never_acts_trains_exactly_like_plain_fp16(tmp_path, cls):
    runs = {}
    for mode in ("fp16_plain", "fp16_scaler_per_order"):
        cfg = load_config(cls.name, [*SIZES, *TINY[cls], f"mode={mode}"], checks=cls.checks)
        summary = train_and_evaluate(cls, cfg, str(tmp_path / mode), progress=False, plots=False)
        runs[mode] = (summary, read(tmp_path / mode / "metrics.jsonl"))
    (plain, plain_recs), (scaled, scaled_recs) = runs["fp16_plain"], runs["fp16_scaler_per_order"]
    assert len(scaled_recs) == len(plain_recs) == STEPS
    # Not vacuous: the scaler was on, no derivative key ever overflowed, every scale stayed 2^0.
    scale_keys = [k for k in scaled_recs[0] if k.startswith("scale_log2/") and k != "scale_log2/loss"]
    assert scale_keys and all(r[k] == 0 for r in scaled_recs for k in scale_keys)
    assert not any(r["skip_reason"] == 1 for r in scaled_recs)
    assert [r["loss"] for r in scaled_recs] == [r["loss"] for r in plain_recs]
    assert [r["skipped"] for r in scaled_recs] == [r["skipped"] for r in plain_recs]
    assert scaled["rel_l2"] == plain["rel_l2"] and scaled_recs[-1]["loss"] < scaled_recs[0]["loss"]
