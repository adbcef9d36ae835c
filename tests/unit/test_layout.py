"""The repo's layout rules (README "Layout"): which package holds what and which way imports go.

- No module of the package (or rewards/) imports one that imports it back, function-local and relative
  imports (`from . import x`, `from ..x import y`, resolved against the importing module's package)
  included: the graph of `openrlhf_lora_sync.*` and `rewards.*` imports has no cycle. Negative controls:
  planted cycles, one of absolute names and one of relative imports in a package written to a temporary
  directory, are found.
- The runtime modules never import `openrlhf_lora_sync.tools` or `.testing`; `testing` never imports
  `tools`.
- No code edits sys.path; scripts/*.py are entry points only (run a package module's `__main__`).
- The package works installed non-editably: pins come from the packaged versions.toml. pip builds from a
  copy of what the build reads (pyproject.toml, versions.toml, patches/openrlhf_lora_sync, rewards/) in a
  temporary directory, so the checkout gets no build/ or *.egg-info (a stale build/lib can carry deleted
  modules into a later install); the test asserts the checkout's build/ and *.egg-info are as before.
Read from the sources with ast (nothing imported), except the non-editable install, which pip builds.
Does not cover: imports made by name at run time (importlib, runpy, OpenRLHF loading reward files by path).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "patches" / "openrlhf_lora_sync"
PACKAGES = (PACKAGE_DIR, ROOT / "rewards")


def module_name(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from ... import` reads: a relative one resolved as Python does, against the
    importer's package (the module itself for an __init__.py), one level up per further dot."""
    if node.level == 0:
        return node.module
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level - 1 >= len(package):
        raise ValueError(f"{importer}: relative import beyond the top-level package")
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The package modules `path` (module `name`) imports anywhere in its body, relative imports included
    (`from pkg import mod` and `from . import mod` count as mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            module = imported_from(node, name, path.name == "__init__.py")
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                found.add(candidate if candidate in known else module)
    return {found_name for found_name in found if found_name in known}


def import_graph(package_dirs=PACKAGES) -> dict[str, set[str]]:
    paths = {module_name(p, d): p for d in package_dirs for p in d.rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(path, name, known) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root / "pkg"


def test_cycle_finder_finds_a_planted_cycle(tmp_path):  # the negative controls of the next test
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # The same cycle made only of relative imports, one of them function-local and two levels up.
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "from .sub.c import f\n",
        "pkg/sub/__init__.py": "from .c import f\n",
        "pkg/sub/c.py": "def f():\n    from ..a import name\n",
    }
    graph = import_graph([_write_package(tmp_path / "cycle", files)])
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": {"pkg.sub.c"},
        "pkg.sub.c": {"pkg.a"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    files["pkg/sub/c.py"] = "def f():\n    from .. import name\n"  # the package itself: no cycle
    graph = import_graph([_write_package(tmp_path / "acyclic", files)])
    assert graph["pkg.sub.c"] == {"pkg"} and find_cycle(graph) is None


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 30 and "openrlhf_lora_sync.settings" in graph["openrlhf_lora_sync.recipe"]
    assert "rewards.math_answer" in graph["rewards"]
    assert find_cycle(graph) is None, find_cycle(graph)


def test_imports_go_from_tools_to_testing_to_the_runtime_never_back():
    graph = import_graph()
    tools, testing = "openrlhf_lora_sync.tools", "openrlhf_lora_sync.testing"
    wrong = {
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if (not module.startswith((tools, testing)) and target.startswith((tools, testing)))
        or (module.startswith(testing) and target.startswith(tools))
    }
    assert not wrong


def test_nothing_edits_sys_path_and_scripts_only_run_package_modules():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("scripts", "patches", "rewards")
        for path in (ROOT / folder).rglob("*.py")
        if "sys.path" in path.read_text()
    ]
    assert not offenders
    for script in (ROOT / "scripts").glob("*.py"):
        tree = ast.parse(script.read_text())
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
        assert len(calls) == 1 and ast.unparse(calls[0].func) == "runpy.run_module", script.name
        target = calls[0].args[0].value
        assert (PACKAGE_DIR.parent / (target.replace(".", "/") + ".py")).is_file(), script.name


@pytest.mark.parametrize("module", ["settings", "pins"])
def test_settings_and_pins_import_only_the_standard_library_at_load(module):
    """settings is read by every process, pins runs before any virtual environment exists."""
    body = ast.parse((PACKAGE_DIR / f"{module}.py").read_text()).body
    top = {alias.name.split(".")[0] for node in body if isinstance(node, ast.Import) for alias in node.names}
    top |= {
        node.module.split(".")[0] for node in body if isinstance(node, ast.ImportFrom) and node.level == 0
    }
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top


BUILD_OUTPUTS = ("build", "*.egg-info", "patches/*.egg-info", "rewards/*.egg-info")


def _build_outputs(folder: Path) -> dict[str, int]:
    """Every file and folder under `folder`'s BUILD_OUTPUTS, with its modification time."""
    tops = [top for pattern in BUILD_OUTPUTS for top in folder.glob(pattern)]
    found = [path for top in tops for path in [top, *top.rglob("*")]]
    return {str(path.relative_to(folder)): path.lstat().st_mtime_ns for path in found}


def _tree(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


def test_a_non_editable_install_reads_its_packaged_pins(tmp_path):
    # pip builds in the source tree it is given: a copy of what the build reads, so the checkout's build/
    # and *.egg-info are never written (the package's versions.toml stays a symlink, as in the checkout).
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "versions.toml"):
        shutil.copy2(ROOT / name, source / name)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(PACKAGE_DIR, source / "patches" / PACKAGE_DIR.name, symlinks=True, ignore=skip)
    shutil.copytree(ROOT / "rewards", source / "rewards", symlinks=True, ignore=skip)
    assert (source / "patches" / PACKAGE_DIR.name / "versions.toml").is_symlink()
    copied, checkout_outputs = _tree(source), _build_outputs(ROOT)
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            target,
            source,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert _build_outputs(ROOT) == checkout_outputs, "the install wrote build outputs into the checkout"
    # The control of that check: the build wrote its outputs into the copy, and only where BUILD_OUTPUTS
    # looks, so the same outputs in the checkout could not have gone unseen.
    created = _tree(source) - copied
    assert (source / "build").is_dir() and created <= set(_build_outputs(source)), created
    pins_file = target / "openrlhf_lora_sync" / "versions.toml"
    assert pins_file.is_file() and not pins_file.is_symlink()
    probe = (
        "import openrlhf_lora_sync.pins as p, openrlhf_lora_sync.settings as s, rewards;"
        "print(p.__file__); print(p.supported_versions()['openrlhf'], s.read('sync.bucket_mb'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    installed_at, versions = done.stdout.splitlines()
    pinned = tomllib.loads((ROOT / "versions.toml").read_text())["shared"]["openrlhf"]
    assert installed_at.startswith(str(target)) and versions == f"{pinned} 128"
