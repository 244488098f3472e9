"""The package metadata is a promise: pyproject.toml against the repository and the environment.

- the declared license has its file (LICENSE, the Apache License 2.0 text);
- every dependency floor is a version the tests run on (at most the installed one), and
  requires-python admits the running Python;
- every third-party import in tests/ and examples/ is a declared dependency or extra, and the
  ``test`` extra installs what tests/ imports (torch, for the parity tests, is its own extra),
  but the few listed in ``OPTIONAL_UNDECLARED``, which tests/ may only ``pytest.importorskip``;
- every ``python -m`` command of the README names a module that exists, run from the
  repository root (``examples`` is not installed with the package);
- the built wheel holds the top-level package ``jaxamp`` only (torch_ref, the PyTorch
  reference, stays in the repository: the parity tests import it from its root), and installed
  into a fresh venv it runs the README's fp16 port from outside the repository (slow).
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCAL = {"jaxamp", "torch_ref", "examples", "tests", "benchmarks"}
# import name -> distribution, where they differ
DISTRIBUTION = {"yaml": "pyyaml", "orbax": "orbax-checkpoint", "tensorboardX": "tensorboardx"}


def _requirements(extra=None):
    reqs = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def _all_requirements():
    reqs = _requirements()
    for extra in PROJECT["optional-dependencies"]:
        reqs += _requirements(extra)
    return reqs


def _names(reqs):
    return {canonicalize_name(r.name) for r in reqs}


def _imports(folder, skippable=False):
    """{top-level module: first file importing it} of every import (and pytest.importorskip) under
    ``folder``; ``skippable``: only the modules imported nowhere but through ``pytest.importorskip``."""
    found, hard = {}, set()
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], path.relative_to(ROOT))
                if not isinstance(node, ast.Call):
                    hard.add(name.split(".")[0])
    return {m: p for m, p in found.items() if m not in hard} if skippable else found


# Third-party modules that tests may use without declaring them: each only through
# pytest.importorskip (its tests skip without it), and not one the library or the examples need.
OPTIONAL_UNDECLARED = {
    "ml_collections": "tests/test_config.py: AmpConfig(**a ConfigDict's amp), a user's container type",
}


def _third_party(imports):
    return {m: p for m, p in imports.items() if m not in LOCAL and m not in sys.stdlib_module_names}


def test_the_declared_license_has_its_file():
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    # the full text: its nine sections and the appendix, not a notice pointing to it
    for heading in ("1. Definitions.", "2. Grant of Copyright License.", "3. Grant of Patent License.",
                    "4. Redistribution.", "5. Submission of Contributions.", "6. Trademarks.",
                    "7. Disclaimer of Warranty.", "8. Limitation of Liability.",
                    "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS",
                    "APPENDIX: How to apply the Apache License to your work."):
        assert heading in text, heading
    assert len(text.split()) > 1500


def test_requires_python_admits_the_running_python():
    spec = SpecifierSet(PROJECT["requires-python"])
    assert Version("3.11") in spec  # jax 0.10 and flax 0.12 need >= 3.11
    assert Version(".".join(map(str, sys.version_info[:3]))) in spec


@pytest.mark.parametrize("req", _requirements() + _requirements("test") + _requirements("examples"),
                         ids=str)
def test_every_floor_is_at_most_the_installed_version(req):
    """The floors are the versions the tests ran on: never above what this environment has."""
    installed = Version(metadata.version(req.name))
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert floors, f"{req}: no floor (a dependency's floor is the tested version)"
    for floor in floors:
        assert floor <= installed, f"{req}: installed {installed}"
    assert req.specifier.contains(installed, prereleases=True), f"{req}: installed {installed}"


def test_the_torch_floor_is_the_tested_build():
    (req,) = _requirements("torch")
    assert canonicalize_name(req.name) == "torch" and str(req.specifier) == ">=2.13.0"
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert '"torch==2.13.0"' in setup  # the CPU build, installed before the extra
    try:
        installed = Version(metadata.version("torch"))
    except metadata.PackageNotFoundError:
        pytest.skip("torch not installed")
    assert req.specifier.contains(installed)  # 2.13.0+cpu


@pytest.mark.parametrize("folder", ["tests", "examples", "benchmarks", "jaxamp", "torch_ref"])
def test_every_third_party_import_is_declared(folder):
    declared = _names(_all_requirements())
    optional = set(OPTIONAL_UNDECLARED) & set(_imports(folder, skippable=True)) if folder == "tests" else set()
    missing = {m: str(p) for m, p in _third_party(_imports(folder)).items()
               if canonicalize_name(DISTRIBUTION.get(m, m)) not in declared and m not in optional}
    assert not missing, f"imported but not in pyproject.toml's dependencies or extras: {missing}"


def test_the_optional_undeclared_test_imports_are_only_importorskip():
    """An undeclared module the tests use must stay optional: only ``pytest.importorskip``
    under tests/ (its tests skip without it), never a plain import, never in the library or
    the examples."""
    skippable = _imports("tests", skippable=True)
    for module in OPTIONAL_UNDECLARED:
        assert module not in _imports("tests") or module in skippable, f"{module}: a plain import in tests/"
        for folder in ("jaxamp", "examples", "benchmarks"):
            assert module not in _imports(folder), f"{module} imported under {folder}/"
    assert not {canonicalize_name(m) for m in OPTIONAL_UNDECLARED} & _names(_all_requirements())


def test_the_library_imports_only_its_dependencies():
    core = _names(_requirements())
    # omegaconf: imported only to convert a DictConfig the caller passes (jaxamp/config.py); equinox:
    # only to wrap an Equinox module the caller passes (placement/eqx_module.py, imported when
    # equinox already is)
    used = {canonicalize_name(DISTRIBUTION.get(m, m)) for m in _third_party(_imports("jaxamp"))} - {"omegaconf",
                                                                                                  "equinox"}
    assert used <= core, used - core


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_the_test_extra_installs_what_the_tests_import():
    """``pip install -e ".[test]"`` (plus ``[torch]`` for tests/parity) is enough for tests/ and
    the examples they run."""
    have = _names(_requirements() + _requirements("test"))
    need = _third_party(_imports("tests")) | _third_party(_imports("examples"))
    need = {m: p for m, p in need.items() if m not in set(OPTIONAL_UNDECLARED) & set(_imports("tests", skippable=True))}
    torch_extra = _names(_requirements("torch"))
    missing = {m: str(p) for m, p in need.items()
               if canonicalize_name(DISTRIBUTION.get(m, m)) not in have | torch_extra}
    assert not missing, missing
    assert _names(_requirements("examples")) <= have


def test_readme_module_commands_exist_from_the_repository_root():
    readme = (ROOT / "README.md").read_text()
    modules = set(re.findall(r"python -m ([A-Za-z_][\w.]*)", readme))
    assert {"examples.poisson_quickstart", "examples.jax_user.fp16", "examples.flax_user.fp16"} <= modules, modules
    assert "repository root" in readme  # examples/ is not installed: the commands run from the root
    for module in sorted(modules - {"pytest", "pip", "venv"}):
        assert module.split(".")[0] in LOCAL, module
        assert find_spec(module) is not None, module  # tests run with the root on sys.path
        assert (ROOT / (module.replace(".", "/") + ".py")).exists() or (
            ROOT / module.replace(".", "/") / "__main__.py").exists(), module


def test_torch_ref_is_imported_from_the_repository_root():
    """The parity tests' ``import torch_ref`` finds the repository's copy (pytest's pythonpath),
    not an installed one: the distribution no longer ships it."""
    spec = find_spec("torch_ref")
    assert spec is not None and Path(spec.origin).resolve() == ROOT / "torch_ref" / "__init__.py", spec
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.distribution("torch_ref")
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not any(p.startswith("torch_ref") for p in find["include"]), find


def _readme_port() -> str:
    """The fp16 port of the README's diff: its unchanged and ``+`` lines (tests/test_readme.py
    checks the diff and runs both its sides in the repository)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Your JAX code in fp16"):]
    diff = re.search(r"^```diff\n(.*?)^```$", section, flags=re.M | re.S).group(1)
    return "\n".join(line[1:] for line in diff.splitlines() if not line.startswith("-")) + "\n"


_IGNORED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__",
                                  ".pytest_cache", "out")


@pytest.mark.slow  # builds the wheel, a venv and imports jax in it (about 20-40 s on 2 cores)
def test_the_wheel_holds_jaxamp_only_and_runs_the_readme_port_outside_the_repository(tmp_path):
    # build from a copy of the tree (what a clone holds), so nothing is written into the repository
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_IGNORED)
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(src)], capture_output=True, text=True, env=env, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("jaxamp_pinn-*.whl")

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (record,) = [n for n in names if n.endswith(".dist-info/RECORD")]
        recorded = [row.split(",")[0] for row in z.read(record).decode().splitlines() if row]
        info = record.rsplit("/", 1)[0]
        top_level = z.read(f"{info}/top_level.txt").decode().split() if f"{info}/top_level.txt" in names else None
    assert sorted(recorded) == sorted(names)
    assert {n.split("/")[0] for n in recorded} == {"jaxamp", info}, sorted({n.split("/")[0] for n in recorded})
    assert top_level in (None, ["jaxamp"]), top_level
    assert "jaxamp/__init__.py" in recorded and "jaxamp/py.typed" in recorded
    assert not [n for n in recorded if n.startswith(("torch_ref", "examples", "tests", "benchmarks"))]

    # a fresh venv holding only the wheel; its dependencies come from this environment's
    # site-packages (a .pth added after the install: nothing is downloaded, pip sees no jaxamp-pinn)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                              "-q", str(wheel)], capture_output=True, text=True, env=env, timeout=300)
    assert install.returncode == 0, install.stderr
    site_dir = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    installed = sorted(p.name for p in site_dir.iterdir() if p.name != "__pycache__")
    assert [n for n in installed if not n.endswith(".dist-info")] == ["jaxamp"], installed
    (site_dir / "_deps_from_test_env.pth").write_text(sysconfig.get_path("purelib") + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "port.py").write_text(_readme_port())
    check = (
        "import importlib.util, sys, jaxamp\n"
        f"assert jaxamp.__file__.startswith({str(site_dir)!r}), jaxamp.__file__\n"
        "assert importlib.util.find_spec('torch_ref') is None\n"
        "assert importlib.util.find_spec('examples') is None\n"
        "print('jaxamp from', jaxamp.__file__)\n"
    )
    r = subprocess.run([str(py), "-c", check], cwd=outside, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(py), "port.py"], cwd=outside, capture_output=True, text=True,
                       env=dict(env, JAX_PLATFORMS="cpu"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    printed = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", r.stdout, flags=re.M)]
    assert len(printed) >= 2 and all(v == v and abs(v) != float("inf") for v in printed), r.stdout
    assert printed[-1] < printed[0], r.stdout
