"""The docstring examples under jaxamp/ stay honest.

scripts/test.sh runs every ``>>>`` example (``--doctest-modules jaxamp``). An example that
cannot run (it needs a trained network, a batch, a user's own function) is kept and marked
``# doctest: +SKIP``; its docstring must then say why, with a line containing ``Not run``
(e.g. "(Not run: needs a trained engine and a batch.)") before the example. These checks read
the sources only (no import, no JAX).
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxamp"
REASON = "not run"  # case-insensitive marker of a skip's reason
SKIP = re.compile(r"#\s*doctest:.*\+SKIP")
PROMPT = re.compile(r"^\s*>>>", re.M)


def _docstrings(path):
    """``(first line, docstring)`` of the module and of every class and function in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def _sources():
    paths = sorted(PACKAGE.rglob("*.py"))
    assert paths, f"no sources under {PACKAGE}"
    return paths


def test_every_skipped_example_says_why():
    bad = []
    for path in _sources():
        for line, doc in _docstrings(path):
            skipped = [i for i, text in enumerate(doc.splitlines()) if PROMPT.match(text) and SKIP.search(text)]
            if skipped and REASON not in doc.lower():
                bad.append(f"{path.relative_to(ROOT)}:{line + skipped[0]}")
    assert not bad, (
        "docstring examples marked `# doctest: +SKIP` without a reason: add a line such as "
        "'(Not run: needs a trained engine and a batch.)' to the docstring, before the example, "
        "or make the example run: " + ", ".join(bad)
    )


def test_examples_live_in_docstrings():
    """A ``>>>`` line outside a docstring (a comment, a plain string) is never run."""
    bad = []
    for path in _sources():
        in_docs = sum(len(PROMPT.findall(doc)) for _, doc in _docstrings(path))
        in_file = len(PROMPT.findall(path.read_text()))
        if in_file != in_docs:
            bad.append(f"{path.relative_to(ROOT)} ({in_file} '>>>' lines, {in_docs} in docstrings)")
    assert not bad, "'>>>' examples outside docstrings (doctest does not run them): " + ", ".join(bad)


def test_the_fast_suite_runs_the_doctests():
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "--doctest-modules" in script and "jaxamp" in script
