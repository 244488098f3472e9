"""Random derivative programs (:mod:`benchmarks.idioms_random`, issue #56): jaxamp's transforms give
JAX's own values, on a fresh sample each run.

A failure names its seed; reproduce it with ``JAXAMP_IDIOMS_SEED=<seed> pytest tests/test_idioms_random.py``
or ``python -m benchmarks idioms --random 4 --seed <seed>``.
"""

import json
import os

import pytest

from benchmarks import idioms_random as ir


def _seed() -> int:
    env = os.environ.get("JAXAMP_IDIOMS_SEED")
    return int(env) if env else int.from_bytes(os.urandom(3), "little")


def _check(seed: int, index: int, entry: bool = False) -> None:
    prog = ir.generate(seed, index)
    where = f"seed {seed} program {index}: {prog.desc} (JAXAMP_IDIOMS_SEED={seed} to rerun)"
    try:
        got = ir.values_check(prog, entry=entry)
    except Exception as e:  # a form JAX runs and jaxamp refuses is a failure too
        raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
    assert got["error"] <= 1e-3, f"{where}: largest error {got['error']:.3g} against JAX's own (float32)"


# compiling hessian(trace(hessian(u))) through jaxamp takes 4-12 s of CPU: the slow tests' and the benchmark's
HEAVY = ("biharmonic_hessian",)


def _light(prog) -> bool:
    """A program the fast suite compiles in seconds: up to third order, no heavy template (the
    slow tests and the benchmark take the rest)."""
    return prog.template not in HEAVY and ir.order_of(prog) <= 3


def test_random_programs_give_jaxs_values():
    seed = _seed()
    indices = [i for i in range(40) if _light(ir.generate(seed, i))][:3]
    for index in indices:
        _check(seed, index)


def test_random_programs_give_jaxs_values_through_a_scaled_entry_point():
    """The same through ``jaxamp.scaled`` (scale 1, float32 network): the entry point's program
    passes (pruned entries, the chains at one point one plan, bases shared) keep JAX's values."""
    seed = _seed()
    indices = [i for i in range(40) if _light(ir.generate(seed, i))][3:5]
    for index in indices:
        _check(seed, index, entry=True)


@pytest.mark.slow
def test_every_named_form_gives_jaxs_values():
    """One program of each of #56's named forms (templates), the heavy ones included."""
    seed, seen = _seed(), set()
    for index in range(200):
        template = ir.generate(seed, index).template
        if template != "random" and template not in seen:
            seen.add(template)
            _check(seed, index)
    assert len(seen) == 6, f"seed {seed}: templates drawn {sorted(seen)}"


def test_generator_is_reproducible_and_covers_the_forms():
    """The same (seed, index) gives the same program; the named forms of #56 are drawn."""
    seed = _seed()
    assert ir.generate(seed, 3).desc == ir.generate(seed, 3).desc
    descs = [ir.generate(seed, i).desc for i in range(300)]
    text = "\n".join(descs)
    for form in ("jacfwd(jacrev(", "trace(hessian(trace(hessian(", "laplacian(laplacian(", "jvp(", "{t:R",
                 "jax.checkpoint", "flax", "[scalar_chain]", "[vector_field]", "[grad_t_hessian_xy]"):
        assert form in text, f"seed {seed}: no program with {form!r} in 300"
    assert max(ir.order_of(ir.generate(seed, i)) for i in range(50)) == 4


def test_a_program_over_the_time_limit_is_recorded_and_the_run_goes_on(tmp_path):
    """``--program-timeout``: each program in a process of its own; one over the limit is a row
    with its description and ``timeout``, listed in the summary, and the run writes its JSON."""
    out = tmp_path / "r.json"
    result = ir.main(["--random", "2", "--seed", "7", "--no-x64", "--program-timeout", "0.01", "--out", str(out)])
    assert result["summary"]["timeouts"] == [0, 1] and result["summary"]["measured"] == 0
    assert [r["program"] for r in result["programs"]] == [ir.generate(7, i).desc for i in range(2)]
    assert json.loads(out.read_text())["summary"]["timeouts"] == [0, 1]
    with pytest.raises(SystemExit):
        ir.main(["--random", "1", "--program-timeout", "0"])


@pytest.mark.slow  # one program's forms, gradient steps and new shape compiled
def test_a_run_stopped_in_a_later_phase_keeps_the_forms_flops():
    """``program_row`` reports each phase before it starts, the forms' FLOPs from the gradient
    step on (what a ``--program-timeout`` run keeps of a program whose step compile runs away),
    and the summary counts such a program's forms."""
    seen = []
    row = ir.program_row(7, 1, "off", x64=False, progress=seen.append)
    assert "failure" not in row and "phase" not in row
    assert [r["phase"] for r in seen] == ["forms", "gradient step of jaxamp", "gradient step of engine",
                                          "gradient step of jax", "new shape"]
    assert "flops_over_engine" not in seen[0]
    assert all(r["flops_over_engine"] == row["flops_over_engine"] for r in seen[1:])
    stopped = {**seen[1], "timeout": True, "failure": "over --program-timeout"}
    summary = ir.summarize([row, stopped])
    assert summary["measured"] == 2 and summary["measured_every_phase"] == 1 and summary["step_measured"] == 1
    assert summary["timeout_phases"] == {"1": "gradient step of jaxamp"}


@pytest.mark.slow
def test_random_programs_give_jaxs_values_in_float64():
    import jax
    import jax.numpy as jnp

    seed = _seed()
    with jax.enable_x64(True):
        for index in range(6):
            prog = ir.generate(seed, index)
            err = ir.values_check(prog, jnp.float64)["error"]
            assert err <= 1e-9, f"seed {seed} program {index}: {prog.desc}: error {err:.3g} (float64)"


@pytest.mark.slow
def test_nested_scalar_grad_chains_at_the_engines_flops():
    """Nests of ``jaxamp.grad`` over scalar arguments, one mixed partial reached along two orders
    included: XLA FLOPs <= 1.05x the engine's plan of the same derivative set."""
    seed, found, index = _seed(), 0, 0
    while found < 4:
        prog = ir.generate(seed, index)
        index += 1
        if ir.chain_names(prog) is None:
            continue
        found += 1
        row = ir.measure(prog)
        assert row["error_f32"] <= 1e-3, f"seed {seed} program {index - 1}: {prog.desc}"
        ratio = row["flops_over_engine"]
        assert ratio <= 1.05, (f"seed {seed} program {index - 1}: {prog.desc}: FLOPs {ratio}x the engine's "
                               f"({row['flops']})")


# #56's named forms measured through a scaled fp16 step (``measure(prog, "fp16")``: jaxamp.scaled
# under AmpConfig(), the network autocast, the entry point's program passes; the engine's plan under
# the same config). Off an entry point (a plain call) each call is its own plan: the unread entries
# of a top-level trace are computed and two calls at one point share no pass.
NAMED = ("scalar_chain", "jacfwd_jacrev", "biharmonic_hessian", "vector_field", "grad_t_hessian_xy",
         "biharmonic_laplacian")


@pytest.mark.slow
@pytest.mark.parametrize("template", NAMED)
def test_named_form_at_the_engines_flops(template):
    """Each of #56's named forms (a program of that template, a fresh seed) in a scaled fp16 step:
    XLA FLOPs <= 1.05x the engine's plan of the same derivative set, values JAX's own (through
    the entry point, float32 network)."""
    seed = _seed()
    index = next(i for i in range(1000) if ir.generate(seed, i).template == template)
    prog = ir.generate(seed, index)
    where = f"seed {seed} program {index}: {prog.desc}"
    assert ir.values_check(prog, entry=True)["error"] <= 1e-3, where
    row = ir.measure(prog, "fp16")
    assert row["flops_over_engine"] <= 1.05, f"{where}: FLOPs {row['flops_over_engine']}x the engine's"
