"""The rule table (jaxamp._src.core.rules.RULES) is the same whichever jaxamp module is imported
first: a primitive's rules are written where the primitive is defined, and ``import jaxamp``
imports every such module. Each first import runs in a fresh interpreter (those a test asks for at once)."""

import json
import subprocess
import sys

import pytest
from jax.extend import core as jcore

from jaxamp._src.core.rules import RULES, PrimitiveRules, rules_of

FIRST_IMPORTS = (
    "jaxamp._src.core.scaled",
    "jaxamp._src.core.profile",
    "jaxamp._src.derivatives.chain_call",
    "jaxamp._src.core.rules",
    "jaxamp",
)

# The table as JSON: each primitive's name and the rules it has (the fields not at their default).
DUMP = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
from jaxamp._src.core.rules import RULES, NO_RULES
def dump():
    return sorted([p.name, sorted(f for f in vars(NO_RULES) if getattr(r, f) != getattr(NO_RULES, f))]
                  for p, r in RULES.items())
first = dump()
import jaxamp
print(json.dumps({"first": first, "after": dump()}))
"""


def _table():
    return sorted([p.name, sorted(f for f in vars(PrimitiveRules()) if getattr(r, f) != getattr(PrimitiveRules(), f))]
                  for p, r in RULES.items())


def _dump(modules):
    """``{module: {"first": table, "after": table}}``, each module imported first in a fresh
    interpreter (all at once)."""
    procs = {m: subprocess.Popen([sys.executable, "-c", DUMP, m], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for m in modules}
    found = {}
    for m, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"importing {m} first failed:\n{err[-3000:]}"
        found[m] = json.loads(out.strip().splitlines()[-1])
    return found


@pytest.fixture(scope="module")
def tables():
    """The tables of the modules the tests ask for, each interpreter started once."""
    found = {}

    def of(*modules):
        found.update(_dump([m for m in modules if m not in found]))
        return found

    return of


# the core's entry point and the package run fast; each other first import with -m slow
@pytest.mark.parametrize("module", [m if m in ("jaxamp._src.core.scaled", "jaxamp") else
                                    pytest.param(m, marks=pytest.mark.slow) for m in FIRST_IMPORTS])
def test_the_table_does_not_depend_on_the_first_import(tables, module):
    found = tables(module, "jaxamp")
    assert found[module]["first"] == found[module]["after"] == found["jaxamp"]["after"] == _table()


def test_the_table_is_keyed_on_primitive_objects_and_holds_jaxamps_primitives():
    from jaxamp._src.core.boundary import boundary_p
    from jaxamp._src.derivatives.chain_call import chain_p
    from jaxamp._src.placement.tensor_scale import scaled_dot_p

    assert all(isinstance(p, jcore.Primitive) for p in RULES)
    assert rules_of(boundary_p).call == "jaxpr" and rules_of(boundary_p).inline
    assert rules_of(chain_p).expand is not None
    assert rules_of(scaled_dot_p).held_operands is not None
    # a body the interpreters enter is a body the evaluator can enter
    for p, r in RULES.items():
        if r.call or r.custom or r.wrapped:
            assert r.evaluate is not None, p.name


def test_no_jaxamp_module_is_imported_for_its_side_effects():
    """Every jaxamp module a ``jaxamp/_src`` module imports as a module (``from jaxamp._src.core
    import control``) is used there: none is imported only to register something (package
    ``__init__`` files re-export, and are left out)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    src = root / "jaxamp" / "_src"

    def is_module(dotted):
        path = root.joinpath(*dotted.split("."))
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()

    unused = []
    for path in sorted(src.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxamp"):
                names = [a.asname or a.name for a in node.names if is_module(f"{node.module}.{a.name}")]
            elif isinstance(node, ast.Import):
                names = [(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("jaxamp")]
            else:
                continue
            unused += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n not in used]
    assert unused == [], "\n".join(unused)
