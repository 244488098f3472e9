"""The README's code runs as printed, as the doctests run the docstrings.

- its first section is the two commands (demo, tests), and the scripts they name exist;
- the ```diff block of "Your JAX code in fp16" is a whole program twice: its unchanged and
  ``-`` lines are the plain JAX PINN, its unchanged and ``+`` lines the fp16 port. Every name
  each side reads is bound in that side (a static check, so a name read only inside a function
  counts too), and each side trains as printed (its printed loss falls, stays finite; the
  plain side's run is marked slow);
- every ```python block (none yet) runs in order in one namespace, with the same name check.

tests/test_package.py installs the built wheel outside the repository and runs the port there.
"""

import builtins
import contextlib
import io
import math
import re
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str, text: str = README) -> list[str]:
    """The bodies of the fenced ```lang blocks of ``text``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.M | re.S)


def sides(diff: str) -> tuple[str, str]:
    """``(before, after)``: the program without the ``+`` lines and the one without the ``-`` lines."""
    before, after = [], []
    for n, line in enumerate(diff.splitlines(), 1):
        mark, rest = line[:1], line[1:]
        assert mark in ("", " ", "-", "+"), f"diff line {n} is not ' ', '-' or '+': {line!r}"
        if mark != "+":
            before.append(rest)
        if mark != "-":
            after.append(rest)
    return "\n".join(before) + "\n", "\n".join(after) + "\n"


def binds(code: str) -> set[str]:
    """The names ``code``'s module level binds (assignments, imports, defs, classes)."""
    top = symtable.symtable(code, "<README.md>", "exec")
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}


def undefined(code: str, known: frozenset = frozenset()) -> set[str]:
    """Global names ``code`` reads, in any scope, that its module level (nor ``known``, nor builtins) never binds."""
    top = symtable.symtable(code, "<README.md>", "exec")
    bound = binds(code) | set(known) | set(dir(builtins))
    read, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        read |= {s.get_name() for s in table.get_symbols()
                 if s.is_referenced() and (table is top or s.is_global())}
    return read - bound


def run(code: str, namespace: dict) -> str:
    """Execute ``code`` as a script in ``namespace``; its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<README.md>", "exec"), namespace)
    return out.getvalue()


def losses_printed(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", out, flags=re.M)]


def port_diff() -> str:
    section = README[README.index("## Your JAX code in fp16"):]
    (diff, *_) = blocks("diff", section[: section.index("\n## ", 1)])
    return diff


def test_the_two_commands_come_first_and_exist():
    headings = re.findall(r"^## (.+)$", README, flags=re.M)
    assert headings[0] == "The two commands", headings
    first = README[README.index("## The two commands"): README.index("\n## ", README.index("## The two commands") + 1)]
    assert re.search(r"\|\s*demo\s*\|\s*`bash scripts/demo.sh`\s*\|", first)
    assert re.search(r"\|\s*tests\s*\|\s*`bash scripts/test.sh`\s*\|", first)
    assert (ROOT / "scripts" / "demo.sh").exists() and (ROOT / "scripts" / "test.sh").exists()
    assert "python -m pytest" in (ROOT / "scripts" / "test.sh").read_text()


def test_the_name_check_finds_an_undefined_name():
    """The check the README's blocks pass would fail on the old diff's ``amp`` and ``losses``,
    read inside a function or not; a function's own arguments do not bind a module-level name."""
    old = ("import jaxamp\ndef u_net(params, t, x):\n    return jaxamp.autocast(model.apply, amp)(params, x)\n"
           "amp_state = jaxamp.init(losses, amp)(params, batch)\n")
    assert undefined(old) == {"model", "amp", "losses", "params", "batch"}
    assert undefined(old, frozenset({"model", "params", "batch"})) == {"amp", "losses"}
    assert undefined("import jaxamp.x\namp = 1\ndef f(x):\n    return [y for y in x] + [amp, jaxamp]\n") == set()


def test_the_diff_is_two_programs_with_every_name_bound():
    before, after = sides(port_diff())
    assert before != after
    for code in (before, after):
        assert not undefined(code), undefined(code)
    assert "import jaxamp" not in before and "jaxamp." not in before  # plain JAX
    for call in ("jaxamp.autocast(", "jaxamp.init(", "jaxamp.optimizer(", "jaxamp.value_and_grad("):
        assert call in after, call
    # the derivative code is the user's, as written: jax.grad, scaled where it crosses the network
    derivative = [line for line in after.splitlines() if line.startswith("u_xx")]
    assert (derivative == [line for line in before.splitlines() if line.startswith("u_xx")]
            and "jax.grad(" in derivative[0])


def test_every_python_block_has_every_name_bound():
    known = frozenset()
    for code in blocks("python"):
        assert not undefined(code, known), undefined(code, known)
        known |= binds(code)


@pytest.mark.parametrize("side", [
    pytest.param("plain JAX (- lines)", marks=pytest.mark.slow),  # jax alone; its names are checked above
    "fp16 port (+ lines)",
])
def test_each_side_of_the_diff_trains_as_printed(side):
    before, after = sides(port_diff())
    namespace = {"__name__": "__readme__"}
    printed = losses_printed(run(after if "port" in side else before, namespace))
    assert len(printed) >= 2, printed
    assert all(math.isfinite(v) for v in printed), printed
    assert printed[-1] < printed[0] / 10, printed  # it trains, not only runs
    if "port" in side:
        import jaxamp

        state = namespace["opt_state"].amp
        assert isinstance(state, jaxamp.AmpState)
        assert sorted(state.scales) == ["1", "2"]  # a derivative scaler per order of u_xx
        assert namespace["amp"].derivative_scaling


def test_every_python_block_runs_in_order():
    namespace = {"__name__": "__readme__"}
    for code in blocks("python"):
        run(code, namespace)


@pytest.mark.slow
def test_the_ports_jax_grad_and_jaxamp_grad_skip_and_scale_alike_over_300_steps():
    """The README's port keeps the user's ``jax.grad``; written with ``jaxamp.grad`` instead, the
    300 steps of the README's loop give the same scaler keys, the same scales after every step and
    the same steps skipped (with their reasons); the losses agree to float16 rounding."""
    import jax
    import numpy as np

    _, after = sides(port_diff())
    program = after[:after.index("for step in range(300)")]
    swapped = program.replace("u_xx = jax.grad(jax.grad(u_net, argnums=1), argnums=1)",
                              "u_xx = jaxamp.grad(jaxamp.grad(u_net, argnums=1), argnums=1)")
    assert swapped != program

    def trajectory(code):
        ns = {"__name__": "__readme__"}
        exec(compile(code, "README.md", "exec"), ns)
        params, opt_state, out = ns["params"], ns["opt_state"], []
        for step in range(300):
            params, opt_state, loss = ns["train_step"](params, opt_state, ns["sample"](jax.random.PRNGKey(step)))
            out.append((float(loss), int(opt_state.skip_reason),
                        {k: float(v) for k, v in opt_state.amp.scales.items()}, float(opt_state.amp.loss_scale)))
        return out

    kept, ported = trajectory(program), trajectory(swapped)
    assert any(r for _, r, _, _ in kept)  # the loss scale backs off from its start: skipped steps to compare
    assert [s for _, _, s, _ in kept] == [s for _, _, s, _ in ported]  # keys and every step's scales
    assert [(r, ls) for _, r, _, ls in kept] == [(r, ls) for _, r, _, ls in ported]  # skips, loss scale
    np.testing.assert_allclose([x[0] for x in kept], [x[0] for x in ported], rtol=0.05)
