"""The import graph of jaxamp/ (function-level imports included) has no cycle, neither between
modules nor between its subpackages, and every import points to its own layer or a lower one.
(Files are split by concept, not by a line count: there is no length cap.)"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxamp"


def modules():
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path, known):
    """The jaxamp modules ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxamp":
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs if subs and len(subs) == len(node.names) else subs | {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
    return out


def graph():
    mods = modules()
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def cycle_in(edges):
    """One cycle of ``edges`` as a list of nodes, or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = "done"
        return None

    for u in sorted(edges):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def package_of(module):
    """A subpackage's modules count as one node (a layer of ``jaxamp._src``); a top-level module is its own."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[:2] == ["jaxamp", "_src"] else parts[:2])


def test_no_import_cycle_between_modules():
    edges = {m: {t for t in ts if t != "jaxamp"} for m, ts in graph().items() if m != "jaxamp"}
    # a subpackage's __init__ re-exporting its own modules is not a cycle
    for m in edges:
        edges[m] = {t for t in edges[m] if not t.startswith(m + ".")}
    assert cycle_in(edges) is None, " -> ".join(cycle_in(edges))


def test_no_import_cycle_between_subpackages():
    edges = {}
    for m, targets in graph().items():
        if m == "jaxamp":
            continue
        src = package_of(m)
        edges.setdefault(src, set()).update(package_of(t) for t in targets if package_of(t) not in (src, "jaxamp"))
    assert cycle_in(edges) is None, " -> ".join(cycle_in(edges))


def test_the_checker_finds_a_cycle():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_declares_its_public_names(module):
    import importlib

    mod = importlib.import_module(module)
    assert isinstance(getattr(mod, "__all__", None), (list, tuple)), f"{module} has no __all__"
    assert [n for n in mod.__all__ if not hasattr(mod, n)] == []


# jaxamp/_src's layers, lowest first: a module imports from its own layer or a lower one only.
LAYERS = ("scaling", "core", "taylor", "derivatives", "placement", "training", "models")


def layer_of(module):
    """The layer index of a ``jaxamp._src`` module; the public modules sit above every layer."""
    parts = module.split(".")
    if parts[:2] != ["jaxamp", "_src"]:
        return len(LAYERS)
    return LAYERS.index(parts[2]) if len(parts) > 2 else -1


def test_every_import_points_to_its_own_layer_or_a_lower_one():
    up = sorted(f"{m} -> {t}" for m, ts in graph().items() for t in ts
                if m.startswith("jaxamp._src.") and layer_of(t) > layer_of(m))
    assert up == []


def test_every_src_module_is_in_a_layer_and_the_public_modules_only_re_export():
    assert {m.split(".")[2] for m in modules() if m.startswith("jaxamp._src.")} == set(LAYERS)
    for m, path in modules().items():
        if m.startswith("jaxamp._src") or m == "jaxamp":
            continue
        body = [n for n in ast.parse(path.read_text()).body if not isinstance(n, ast.Expr)]  # docstring
        assert all(isinstance(n, (ast.ImportFrom, ast.Assign, ast.AnnAssign)) for n in body), m


def test_the_layer_checker_finds_an_upward_import():
    assert layer_of("jaxamp._src.core.scaled") < layer_of("jaxamp._src.derivatives.grad") < layer_of("jaxamp.models")


def test_no_line_is_shaped_for_a_formatter_or_past_120_characters():
    """Files are split by concept and lines wrapped by hand: no formatter's skip comment and no line over
    120 characters anywhere under jaxamp/, benchmarks/, examples/, tests/ or torch_ref/."""
    marker = "fmt" + ": skip"  # built so that this file's own lines do not match
    found = []
    for folder in ("jaxamp", "benchmarks", "examples", "tests", "torch_ref"):
        for path in sorted((ROOT.parent / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if marker in line or len(line) > 120:
                    found.append(f"{path.relative_to(ROOT.parent)}:{number}")
    assert not found, found
