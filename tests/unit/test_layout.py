"""The repo's layout rules (README "Layout"): which package holds what and which way imports go.

- No module of the package (or rewards/) imports one that imports it back, function-local imports
  included: the graph of `openrlhf_lora_sync.*` imports has no cycle.
- The runtime modules never import `openrlhf_lora_sync.tools` or `.testing`; `testing` never imports
  `tools`.
- No code edits sys.path; scripts/*.py are entry points only (run a package module's `__main__`).
- The package works installed non-editably: pins come from the packaged versions.toml.
Read from the sources with ast (nothing imported), except the non-editable install, which pip builds.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "patches" / "openrlhf_lora_sync"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in its body (`from pkg import mod` counts as mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
    return {name for name in found if name in known}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(path, known) - {name} for name, path in paths.items()}


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


def test_cycle_finder_finds_a_planted_cycle():  # the negative control of the next test
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 30 and "openrlhf_lora_sync.settings" in graph["openrlhf_lora_sync.recipe"]
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


def test_a_non_editable_install_reads_its_packaged_pins(tmp_path):
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
            ROOT,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
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
