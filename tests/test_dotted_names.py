"""Every dotted ``jaxamp.`` name written in the library, torch_ref, README.md, docs/ and examples/
(docstrings, error texts, docs) resolves to a module or an attribute (CHANGELOG is history)."""

import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bjaxamp(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def written_names():
    files = [p for d in ("jaxamp", "torch_ref", "docs", "examples") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md")] + [ROOT / "README.md"]
    seen = {}
    for path in files:
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in NAME.finditer(line):
                seen.setdefault(match.group(0).rstrip("."), f"{path.relative_to(ROOT)}:{i}")
    return seen


def resolves(name):
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_written_jaxamp_name_resolves():
    names = written_names()
    assert len(names) > 50  # the scan reads the files
    unresolved = {n: where for n, where in names.items() if not resolves(n)}
    assert unresolved == {}


def test_the_resolver_rejects_a_missing_name():
    assert resolves("jaxamp.grad") and resolves("jaxamp._src.core.profile.scaler_keys")
    assert not resolves("jaxamp._src.derivatives.scaler_keys") and not resolves("jaxamp.train_step")
