"""No ambient or identity-keyed state in the library: what a jaxamp call computes depends on its
arguments and the program it traces, not on what ran before it or on object addresses.

The rule, checked on the syntax of every file under ``jaxamp/`` (a failure names ``file:line``):

1. **No identity keys**: the builtin ``id`` is never called or passed (``id(x)``, ``map(id, xs)``):
   an address is reused once its object dies. Key on the object itself, held by the map (a JAX
   ``Var``, a ``JaxprEqn``, a ``Jaxpr``), on a position, or compare with ``is``.
2. **No thread-, context- or weakly-keyed tables**: no ``threading.local``, ``contextvars``,
   ``weakref`` and no ``functools.lru_cache``/``functools.cache``.
3. **Module-level containers are constant tables**: a dict, list, set, ``collections``
   container or comprehension bound at module level may be filled by module-level statements
   only (at import, as :data:`jaxamp._src.core.rules.RULES` is by the module defining each
   primitive). A write to one from inside a function body (``T[k] = v``, ``del T[k]``,
   ``T.append/update/setdefault/pop/...``, through its module too: ``mod.T[k] = v``) is a
   cache or ambient state; so is a ``global`` statement.

State that belongs to one call lives in an object that call creates and passes down (an
evaluation's ``Context``, an expansion's ``_Expanding``) or in the closure of the function the
user holds (``autocast``'s traced programs).

There are no exceptions: the AMP config reaches a program as an argument of the entry point that
traces it (``jaxamp.init``, ``scaled``, ``value_and_grad``) or of ``autocast``, never from a
context.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "jaxamp"

# (file relative to the repository, the flagged text) -> why it stays
CONTAINER_CALLS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter", "WeakKeyDictionary",
                   "WeakValueDictionary"}
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add", "discard",
            "remove", "appendleft", "popleft", "move_to_end"}
BANNED_MODULES = {"threading.local", "contextvars", "weakref", "functools.lru_cache", "functools.cache"}


def _is_container(value):
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        return name in CONTAINER_CALLS
    return False


def _targets(node):
    if isinstance(node, ast.Assign):
        return node.targets, node.value
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        return [node.target], node.value
    return [], None


def module_containers(tree):
    """The names bound at module level to a mutable container."""
    found = set()
    for node in tree.body:
        targets, value = _targets(node)
        if value is not None and _is_container(value):
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return found


def _root_name(node):
    """``T`` of ``T``, ``T[k]``, ``mod.T``, ``mod.T[k]`` (the container's name), else None."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _locals(fn):
    """Names a function binds itself (arguments, assignments): they shadow module names."""
    names = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def violations(path, containers):
    """``[(line, text)]`` of the rule's violations in ``path`` (``containers``: the module-level
    container names of the whole library)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "id" and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, "id"))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                full = f"{mod}.{alias.name}" if mod else alias.name
                if any(full == b or full.startswith(b + ".") or mod == b for b in BANNED_MODULES):
                    found.append((node.lineno, full))
        if isinstance(node, ast.Attribute) and _dotted(node) in BANNED_MODULES:
            found.append((node.lineno, _dotted(node)))
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]:
        own = _locals(fn) if not isinstance(fn, ast.Lambda) else {a.arg for a in ast.walk(fn.args)
                                                                   if isinstance(a, ast.arg)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.append((node.lineno, "global " + ", ".join(node.names)))
            written = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                written = [t for t in targets if isinstance(t, ast.Subscript)]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                written = [node.func.value]
            for target in written:
                name = _root_name(target)
                base = target
                while isinstance(base, ast.Subscript):
                    base = base.value
                through_module = isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                if name in containers and (through_module or (isinstance(base, ast.Name) and name not in own)):
                    found.append((node.lineno, f"{name} written in a function"))
    return found


def all_violations():
    files = sorted(LIBRARY.rglob("*.py"))
    containers = set()
    for path in files:
        containers |= module_containers(ast.parse(path.read_text()))
    out = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        for line, text in violations(path, containers):
            out.append(f"{rel}:{line}: {text}")
    return out


def test_no_module_level_cache_ambient_state_or_identity_key():
    found = all_violations()
    assert found == [], "ambient or identity-keyed state (see this test's docstring):\n" + "\n".join(found)


def test_the_checker_finds_each_kind(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import threading\nimport weakref\nCACHE = {}\nSEEN = []\nTABLE = {1: 2}\nTABLE[3] = 4\n"
        "_LOCAL = threading.local()\n"
        "def f(x):\n    CACHE[id(x)] = x\n    SEEN.append(x)\n"
        "def g(CACHE):\n    CACHE[1] = 2\n"  # an argument shadowing the module name: fine
        "def h():\n    global SEEN\n    SEEN = None\n")
    tree = ast.parse(bad.read_text())
    found = violations(bad, module_containers(tree))
    assert sorted(found) == [(2, "weakref"), (7, "threading.local"),
                             (9, "CACHE written in a function"), (9, "id"), (10, "SEEN written in a function"),
                             (14, "global SEEN")], found
