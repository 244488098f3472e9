"""The public surface is small and every name of it is shown to users.

``jaxamp.__all__`` plus the public submodules (``jaxamp.models``, ``jaxamp.parallel``: the
modules outside ``jaxamp._src``) and their ``__all__`` hold at most :data:`LIMIT` names, and each
name appears in the README, a page of docs/ or an example, spelled as a user writes it
(``jaxamp.grad``, ``from jaxamp import grad``, ``jaxamp.models.FullyConnected``, ...).
"""

import pathlib
import pkgutil
import re

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 35


def public_modules():
    return {m.name: __import__(f"jaxamp.{m.name}", fromlist=["_"]) for m in pkgutil.iter_modules(jaxamp.__path__)
            if not m.name.startswith("_")}


def public_names():
    """``(dotted name, bare name)`` of every public name, the modules included."""
    names = [(f"jaxamp.{n}", n) for n in jaxamp.__all__]
    for mod_name, mod in public_modules().items():
        names.append((f"jaxamp.{mod_name}", mod_name))
        names += [(f"jaxamp.{mod_name}.{n}", n) for n in mod.__all__]
    return names


def user_text():
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.py")]
    return "\n".join(f.read_text() for f in files)


def test_at_most_the_limit_of_public_names():
    names = public_names()
    assert len(names) <= LIMIT, [d for d, _ in names]
    assert set(public_modules()) == {"models", "parallel"}


def test_every_public_name_resolves_and_is_shown_to_users():
    text = user_text()
    for dotted, bare in public_names():
        obj = jaxamp
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part)  # resolves
        module = dotted.rsplit(".", 1)[0]
        # the dotted spelling, or the name imported from its module
        imported = re.search(rf"from {re.escape(module)} import [^\n]*\b{bare}\b", text)
        assert dotted in text or imported, f"{dotted} appears in no README, docs/ page or example"
