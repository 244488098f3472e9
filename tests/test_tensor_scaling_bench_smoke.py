"""benchmarks/tensor_scaling.py: each variant's keys reach the cavity's config, and (slow) a
few-step run of every problem writes rows with errors, skipped steps and scales."""

import json
import math

import pytest

from benchmarks import tensor_scaling as TS
from examples.common.config import check_amp, load_config
from examples.ldc import LDC


@pytest.mark.parametrize("variant", sorted(TS.VARIANTS))
def test_variant_keys_reach_the_cavity_config(variant):
    cfg = load_config("ldc_demo", TS._overrides(variant, 7, 1), checks=LDC.checks)
    amp = check_amp(cfg["amp"])
    assert cfg["seed"] == 1 and cfg["training"]["max_steps"] == 7
    if variant == "fp32":
        assert not amp.enabled
        return
    assert amp.enabled and amp.autocast_firstlayer == TS.VARIANTS[variant].get("autocast_firstlayer", True)
    for key, value in TS.VARIANTS[variant].items():
        assert getattr(amp, key) == value, (key, getattr(amp, key), value)


def test_tables_and_summary_from_rows():
    rows = [
        {"problem": "p", "steps": 5, "seed": s, "variant": v, "error": e, "over_fp32": e / 0.1,
         "skipped_steps": 0, "final_scale_log2": {"1": 0.0, "loss": 16.0}}
        for s in (0, 1) for v, e in (("fp32", 0.1), ("fp8_recipe", 0.3), ("fp8_plain", math.inf))
    ]
    summ = TS.summary(rows)
    assert summ["fp8_recipe"]["median_over_fp32"] == pytest.approx(3.0)
    assert summ["fp8_plain"]["median_over_fp32"] == math.inf
    text = TS.tables(rows)
    assert "| fp8_recipe | 0.3 (3.00) | 0 | 1:0, loss:16 |" in text and "non-finite" in text


@pytest.mark.slow  # ~1 min of CPU: six short trainings, each compiled
def test_every_problem_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "ts.json"
    TS.main(["--problem", *TS.PROBLEMS, "--steps", "3", "--seeds", "0", "--variants", "fp32", "fp8_tangent_e5m2",
             "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [(r["problem"], r["variant"]) for r in runs] == [(p, v) for p in TS.PROBLEMS
                                                            for v in ("fp32", "fp8_tangent_e5m2")]
    for r in runs:
        assert math.isfinite(r["error"]) and 0 <= r["skipped_steps"] <= 3 and r["over_fp32"] > 0
        if r["variant"] != "fp32":
            assert "loss" in r["final_scale_log2"] and {"1", "2"} <= set(r["final_scale_log2"])
    capsys.readouterr()
    TS.main(["--tables", str(out)])
    text = capsys.readouterr().out
    assert all(f"**{p}**" in text for p in TS.PROBLEMS) and "| fp8_tangent_e5m2 |" in text


def test_tables_of_several_files_take_the_first_run_and_any_files_fp32_ratio(tmp_path, capsys):
    def row(variant, error, seed=0, over=None):
        return {"problem": "p", "steps": 5, "seed": seed, "variant": variant, "keys": TS.VARIANTS[variant],
                "error": error, "over_fp32": over, "skipped_steps": 0, "final_scale_log2": {"loss": 16.0}}

    newer, older = tmp_path / "new.json", tmp_path / "old.json"
    newer.write_text(json.dumps({"runs": [row("fp8_recipe", 0.3)]}))  # run without fp32: no ratio of its own
    older.write_text(json.dumps({"runs": [row("fp32", 0.1, over=1.0), row("fp8_recipe", 0.5, over=5.0)]}))
    runs = TS.main(["--tables", str(newer), str(older)])["runs"]
    recipe = [r for r in runs if r["variant"] == "fp8_recipe"]
    assert len(recipe) == 1 and recipe[0]["error"] == 0.3 and recipe[0]["over_fp32"] == pytest.approx(3.0)
    text = capsys.readouterr().out
    assert text.index("| fp32 |") < text.index("| fp8_recipe | 0.3 (3.00)")  # rows in the variants' order
