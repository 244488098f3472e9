"""Line counts of a port: what a user adds or changes going from fp32.py to fp16.py."""

import ast
import difflib
from pathlib import Path
from typing import List


def added_lines(before: Path, after: Path) -> List[str]:
    """The lines of ``after`` that are new or changed against ``before``."""
    diff = difflib.unified_diff(before.read_text().splitlines(), after.read_text().splitlines(), lineterm="", n=0)
    return [d[1:] for d in diff if d.startswith("+") and not d.startswith("+++")]


def _function_lines(path: Path, name: str) -> List[str]:
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return lines[node.lineno - 1: node.end_lineno]
    raise AssertionError(f"{path} has no function {name!r}")


def function_changes(before: Path, after: Path, name: str) -> int:
    """How many lines of function ``name`` a port adds or changes (a changed line counts once)."""
    a, b = _function_lines(before, name), _function_lines(after, name)
    diff = list(difflib.unified_diff(a, b, lineterm="", n=0))
    added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
    removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
    return max(added, removed)
