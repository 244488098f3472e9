"""amp.init_scales_from_profile on a problem posed in physical units whose derivatives overflow
float16 at initialization: Burgers with its domain x0.002 (problem.domain_scale), where
u_xx is 2.5e5 times the unit problem's.

With the default scales (every key starts at 1) key 2 overflows on the first steps and the
step is skipped until its scale has backed off; started from the profile's scales it never
overflows in the first 500 steps, and trains as well.
"""

import pytest

import jaxamp
from examples.burgers import Burgers
from examples.common.config import load_config
from examples.common.train import Setup, train_and_evaluate
from tests.helpers.examples import read

PHYSICAL = ["problem.domain_scale=0.002", "batch.initial=100", "batch.boundary=100", "batch.interior=500",
            "training.max_steps=500", "training.chunk_steps=100", "training.checkpoint_every=500",
            "training.tensorboard=false", "eval.grid=51"]


def _run(tmp_path, name, *extra):
    cfg = load_config("burgers", [*PHYSICAL, *extra], checks=Burgers.checks)
    summary = train_and_evaluate(Burgers, cfg, str(tmp_path / name), progress=False, plots=False)
    recs = read(tmp_path / name / "metrics.jsonl")
    skips = [r["step"] for r in recs if r["skip_reason"] == jaxamp.SkipReason.DERIVATIVE_OVERFLOW]
    return summary, skips, recs


def test_the_option_is_off_by_default_and_checked():
    cfg = load_config("burgers", PHYSICAL, checks=Burgers.checks)
    assert cfg["amp"]["init_scales_from_profile"] is False
    with pytest.raises(jaxamp.ConfigError,
                       match=r"amp.init_scales_from_profile=3 has the wrong type: expected true or false"):
        load_config("burgers", ["amp.init_scales_from_profile=3"], checks=Burgers.checks)


@pytest.mark.slow  # profiles the network (its own compilation)
def test_the_option_only_changes_the_scalers():
    on = Setup(Burgers, load_config("burgers", [*PHYSICAL, "amp.init_scales_from_profile=true"], checks=Burgers.checks))
    assert (on.start_scales["2"] < 0 and on.amp.max_scale_log2("2") == 0
            and on.amp.custom_init_scales_log2["2"] == on.start_scales["2"])
    assert float(on.init_state().amp_state.derivative["2"].scale) == 2.0 ** on.start_scales["2"]


@pytest.mark.slow
def test_profile_scales_skip_nothing_in_the_first_500_steps_where_the_defaults_skip(tmp_path):
    default, default_skips, _ = _run(tmp_path, "default")
    profiled, profiled_skips, recs = _run(tmp_path, "profile", "amp.init_scales_from_profile=true")
    assert default_skips, "the default scales should overflow at first (else this test proves nothing)"
    assert profiled_skips == []
    assert profiled["init_scales_log2_from_profile"]["2"] < 0
    assert all(r["headroom_log2/2"] > 0 for r in recs)
    # the same accuracy: within 10% of the default run's relative L2 error after 500 steps
    assert profiled["rel_l2"] <= 1.1 * default["rel_l2"]
