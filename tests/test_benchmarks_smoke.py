"""The benchmark runner in its seconds-long smoke mode, so that it cannot rot; and the
alternative derivative engines against jaxamp.Derivatives (same values, same flags)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from benchmarks import engines as E
from benchmarks import ldc
from benchmarks.runner import parse_size
from jaxamp.models import FullyConnected

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args):
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "benchmarks", "--preset", "smoke", "--out", str(out), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


def _positive_time(s):
    assert s["n"] >= 1
    for k in ("median", "p25", "p75", "min", "max"):
        assert math.isfinite(s[k]) and s[k] > 0, (k, s)


@pytest.mark.slow  # ~50 s of CPU: two train-step compiles in a fresh process, plus torch
def test_smoke_runner_writes_json_with_positive_finite_times(tmp_path):
    res, stdout = _run(tmp_path, "--sections", "step", "torch", "orders", "--inner", "2")
    assert res["meta"]["backend"] == "cpu" and res["meta"]["preset"] == "smoke"
    assert res["meta"]["config"]["inner"] == 2
    (block,) = res["step"]
    assert set(block["modes"]) == {"fp16_plain", "fp16_scaled_order", "fp16_scaled_order@reverse"}
    for m in block["modes"].values():
        _positive_time(m["step_s"])
        assert m["flops"] > 0 and m["compile_s"] > 0 and m["xla_memory"]["temp_bytes"] > 0
    _positive_time(block["ratios"]["scaler_overhead_order"])
    _positive_time(block["ratios"]["speedup_forward_vs_reverse_fp16_scaled_order"])
    assert "LDC step" in stdout and "scaler_overhead_order" in stdout  # the table is printed
    t = res["torch"]
    if "skipped" not in t:  # torch_ref present: JAX and torch_ref eager on the same step
        r = t["modes"]["fp16_scaled_order"]
        _positive_time(r["jax_s"]), _positive_time(r["torch_eager_s"])
        _positive_time(r["ratio_jax_over_torch_eager"])
    cases = res["orders"]["cases"]
    assert set(cases) == {f"fp16_{cfg}/{kind}/1" for cfg in ("scaled", "unscaled")
                          for kind in ("reverse", "forward", "fwd_nested", "fwd_over_rev")} | {"fp16_unscaled/jet/1"}
    for name, c in cases.items():
        _positive_time(c["time_s"])
        if "/reverse/" not in name:
            assert c["max_rel_diff_vs_reverse"] < 1e-2, (name, c)


@pytest.mark.slow
def test_smoke_memory_section_measures_a_fresh_process(tmp_path):
    res, _ = _run(tmp_path, "--sections", "memory")
    r = res["memory"]["modes"]["fp16_scaled_order"]
    assert "error" not in r, r
    assert r["peak_rss_bytes"] >= r["rss_before_compile_bytes"] > 0


def test_parse_size_rejects_bad_text_and_accepts_defaults():
    s = parse_size("4x128:1000")
    assert (s.nr_layers, s.layer_size, s.n_interior, s.n_lid, s.n_noslip) == (4, 128, 1000, 250, 250)
    with pytest.raises(ValueError, match="4by128"):
        parse_size("4by128")
    with pytest.raises(ValueError, match="nr_layers"):
        parse_size("0x128:10")
    with pytest.raises(ValueError, match="mode='fp8'"):
        ldc.mode_settings("fp8")


def _engines(amp, derivatives, kinds):
    model = FullyConnected.from_amp(amp or jaxamp.AmpConfig(enabled=False), out_features=2, layer_size=16, nr_layers=2)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(2))
    fn = lambda p, x: model.apply(p, x)  # noqa: E731
    kw = dict(inputs=("x", "y"), outputs=("u", "v"), derivatives=derivatives, amp=amp)
    # each engine as jaxamp.scaled runs it: (scales, params, x) -> (values, found_inf)
    return params, {k: jax.jit(jaxamp.scaled(E.make_engine(k, fn, **kw))) for k in kinds}


# The benchmark-only engines are checked against reverse mode in the slow run (each case
# compiles two engines; "forward" is jaxamp.Derivatives' own engine, checked against reverse
# in the fast suite's test_derivatives).
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind, mode", [
    pytest.param("fwd_nested", "per_term_scaler", marks=_SLOW),
    pytest.param("fwd_over_rev", "per_order_scaler", marks=_SLOW),
    pytest.param("forward", "per_order_scaler", marks=_SLOW),
    pytest.param("forward", "per_term_scaler", marks=_SLOW),
    pytest.param("fwd_nested", "per_order_scaler", marks=_SLOW),
    pytest.param("fwd_over_rev", "per_term_scaler", marks=_SLOW),
])
def test_forward_engines_match_reverse_scaled_fp16(mode, kind):
    amp = jaxamp.AmpConfig(dtype="float16", mode=mode)
    ders = ("u__x__x__x", "u__x__y", "v__y__y")
    params, eng = _engines(amp, ders, ("reverse", kind))
    x = jax.random.uniform(jax.random.PRNGKey(1), (8, 2), minval=-1, maxval=1)
    keys = jaxamp.Derivatives(lambda p, x: x, inputs=("x", "y"), outputs=("u", "v"), derivatives=ders, amp=amp)
    scales = {k: jnp.float32(2.0**-3) for k in keys.scaler_keys}
    ref, ref_flags = eng["reverse"](scales, params, x)
    got, flags = eng[kind](scales, params, x)
    assert set(got) == set(ref) and set(flags) == set(ref_flags)
    assert E.max_rel_diff(got, ref) < 5e-3  # float16 rounding differs between the two orders of evaluation
    assert not any(bool(f) for f in flags.values())
    # A NaN point: both engines report bad values (nonfinite_values), not an overflow of a key.
    bad = x.at[3, 0].set(jnp.nan)
    assert {k: bool(v) for k, v in eng[kind](scales, params, bad)[1].items()} == {
        k: bool(v) for k, v in eng["reverse"](scales, params, bad)[1].items()
    }


@_SLOW
def test_forward_engines_and_jet_match_reverse_fp32():
    ders = E.pure_derivatives(3, outputs=("u", "v"))
    params, eng = _engines(None, ders, E.KINDS)
    x = jax.random.uniform(jax.random.PRNGKey(2), (8, 2), minval=-1, maxval=1)
    ref, _ = eng["reverse"]({}, params, x)
    for kind in ("forward", "fwd_nested", "fwd_over_rev", "jet"):
        got, flags = eng[kind]({}, params, x)
        assert set(got) == set(ref) and flags == {}
        np.testing.assert_array_less(E.max_rel_diff(got, ref), 1e-5)


def test_jet_rejects_scaling_and_mixed_derivatives():
    with pytest.raises(ValueError, match="Taylor mode cannot reproduce"):
        _engines(jaxamp.AmpConfig(dtype="float16"), ("u__x__x",), ("jet",))
    with pytest.raises(ValueError, match="mixed"):
        _engines(None, ("u__x__y",), ("jet",))
    with pytest.raises(ValueError, match="kind='taylor'"):
        E.make_engine("taylor", lambda p, x: x, inputs=("x",), outputs=("u",), derivatives=())


@pytest.mark.parametrize("flag", ["--reps", "--inner"])
def test_runner_rejects_non_positive_repetitions_before_any_work(flag, capsys):
    from benchmarks.runner import main

    with pytest.raises(SystemExit):
        main(["--preset", "smoke", "--sections", "step", flag, "0"])
    assert f"{flag}=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.slow  # six small compiles
def test_laplacian_dropin_vs_engine_pairs_every_method(tmp_path):
    from benchmarks import laplacian

    out = tmp_path / "lap.json"
    record = laplacian.main(["--workloads", "dropin_vs_engine", "--dims", "2", "--points", "8", "--width", "8",
                             "--layers", "1", "--reps", "2", "--inner", "1", "--out", str(out)])
    res = record["results"]["dropin_vs_engine"]["2"]
    assert set(res["ratios"]) == {f"{a}/{b}" for a, b in laplacian.PAIRS}
    for ratio in res["ratios"].values():
        assert ratio["time_dropin_over_engine"]["median"] > 0
    assert all(m["time_s"]["median"] > 0 for m in res["methods"].values())
    assert out.exists()


@pytest.mark.slow  # four small train-step compiles and a profiler trace
def test_merge_cost_times_both_programs_and_profiles_them(tmp_path):
    from benchmarks import merge_cost

    record = merge_cost.main(["--preset", "quick", "--n", "16", "--reps", "2", "--profile",
                              "--out", str(tmp_path / "m.json")])
    res = record["results"]["16"]
    assert set(res["cases"]) == {"merge=False", "merge=True"}
    assert res["time_on_over_off"]["median"] > 0 and 0 < res["flops_on_over_off"] < 1
    assert all(sum(kinds.values()) > 0 for kinds in res["op_ms_per_call"].values())


@pytest.mark.slow  # four train-step compiles and their timing: over the fast suite's share
def test_matrix_times_the_autocast_placement_where_tensor_scales_act(monkeypatch):
    """The `autocast` placement (a float32 network placed by jaxamp.autocast) beside
    FullyConnected's float16 one: in both the per-tensor case compiles to more FLOPs than plain
    fp16 (the float32 weights take scales; float16 activations and their cotangents none). Both
    store their float32 values (per-tensor scaling does not recompute them: recompute_float32)."""
    import dataclasses

    from benchmarks import matrix

    for name in ("all_fp16", "autocast"):
        stored = dataclasses.replace(matrix.PLACEMENTS[name], recompute_float32=False)
        monkeypatch.setitem(matrix.PLACEMENTS, name, stored)
    res = matrix.main(["--quick", "--problems", "poisson1d", "--placements", "all_fp16", "autocast",
                       "--modes", "plain", "tensor"])
    cases = res["problems"]["poisson1d"]["cases"]
    assert set(cases) == {f"{p}/{m}" for p in ("all_fp16", "autocast") for m in ("plain", "tensor")}
    extra = {p: cases[f"{p}/tensor"]["flops"] / cases[f"{p}/plain"]["flops"] for p in ("all_fp16", "autocast")}
    assert extra["autocast"] > 1.0 and extra["all_fp16"] > 1.0
    for case in cases.values():
        assert case["step_s"]["median"] > 0


def test_same_program_fingerprints_ignore_source_locations_only():
    import jax
    import jax.numpy as jnp

    from benchmarks.same_program import fingerprint

    def compiled(fn):
        return jax.jit(fn).lower(jnp.ones(3)).compile()

    first = compiled(lambda x: jnp.sin(x) * 2)
    moved = compiled(lambda x: (jnp.sin(x)
                                * 2))  # (the same program from other source lines)
    other = compiled(lambda x: jnp.sin(x) * 3)
    assert fingerprint(first) == fingerprint(moved) != fingerprint(other)


@pytest.mark.slow  # two compiles dumping XLA's LLVM IR and objects: over the fast suite's share
def test_codegen_reads_what_xla_generates_for_a_case_and_compares_two_runs(tmp_path, monkeypatch):
    from benchmarks import codegen

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    out = tmp_path / "codegen.json"
    res = codegen.main(["--problems", "poisson1d", "--modes", "plain", "--reps", "1", "--out", str(out)])
    case = res["cases"]["poisson1d/default/plain"]
    assert case["kernels"] > 10 and case["llvm_ir_bytes"] > 10_000 and case["objects"] > 0 and case["compile_s"] > 0
    ratios = codegen.compare(str(out), str(out))
    assert ratios["poisson1d/default/plain"]["llvm_ir_bytes"] == 1.0
    doubled = json.loads(out.read_text())
    doubled["cases"]["poisson1d/default/plain"]["llvm_ir_bytes"] *= 3
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doubled))
    # runs of one commit are averaged first: (1 + 3) / 2 over 1
    assert codegen.compare([str(out), str(other)], [str(out)])["poisson1d/default/plain"]["llvm_ir_bytes"] == 0.5
