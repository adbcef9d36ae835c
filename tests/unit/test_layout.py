"""The repo's layout rules (docs/layout.md): which package holds what and which way imports go.

- No module of the package (or rewards/) imports one that imports it back, function-local and relative
  imports (`from . import x`, `from ..x import y`, resolved against the importing module's package)
  included: the graph of `openrlhf_lora_sync.*` and `rewards.*` imports has no cycle. Negative controls:
  planted cycles, one of absolute names and one of relative imports in a package written to a temporary
  directory, are found.
- Every module of the package sits in one of its groups (sub-packages), and imports go one way between
  them, in this order (GROUPS): base <- sync <- config <- patch <- testing <- tools. A module imports only
  its own group and the groups before it, never one after it: `base` (settings, pins, upstream) imports
  no other group; `sync` imports only `base` (never `config`, `patch`, `testing` or `tools`); `config`
  imports `base` and `sync` (what the sync refuses), never `patch`; `patch` imports `base`, `sync` and
  `config` (the launcher's checks); `testing` never imports `tools`. The top-level `openrlhf_lora_sync`
  (REPO_ROOT; standard library only) may be imported by every group and imports none. rewards/ imports
  only `base`, and only `tools` imports rewards/. The order is the one the import graph had when the
  groups were drawn (no edge had to change). Negative control: a package written to a temporary
  directory with planted violations (function-local, relative and absolute imports) has exactly those
  found, and its allowed imports not.
- `base` imports only the standard library at load: settings is read by every process, pins runs before
  any virtual environment exists.
- No code edits sys.path; scripts/*.py are entry points only (run a package module's `__main__`).
- Every dotted package path written anywhere in the repo (code strings such as the launcher module, the
  Ray setup hook and scripts' runpy targets, docstrings, docs, README, recipes, scripts) names a module that
  exists, or a name defined at the top of one (`openrlhf_lora_sync.tools.NAME` is the one placeholder;
  this file's own paths are the controls').
  Negative control: a module path from before the package was grouped, and a missing attribute, do not
  resolve.
- pyproject.toml lists every sub-package. The package works installed non-editably: every module is
  installed and pins come from the packaged base/versions.toml. pip builds from a copy of what the build
  reads (pyproject.toml, versions.toml, patches/openrlhf_lora_sync, rewards/) in a temporary directory, so
  the checkout gets no build/ or *.egg-info (a stale build/lib can carry deleted modules into a later
  install); the test asserts the checkout's build/ and *.egg-info are as before.
Read from the sources with ast (nothing imported), except the non-editable install, which pip builds.
Does not cover: imports made by name at run time (importlib, runpy, OpenRLHF loading reward files by path).
"""

from __future__ import annotations

import ast
import itertools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "patches" / "openrlhf_lora_sync"
PACKAGES = (PACKAGE_DIR, ROOT / "rewards")
# The package's groups, in import order: each may import itself and the groups before it (module docstring).
GROUPS = ("base", "sync", "config", "patch", "testing", "tools")


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
    assert len(graph) > 30 and "openrlhf_lora_sync.base.settings" in graph["openrlhf_lora_sync.config.recipe"]
    assert "rewards.math_answer" in graph["rewards"]
    assert find_cycle(graph) is None, find_cycle(graph)


def group_of(module: str) -> str | None:
    """ "rewards", one of GROUPS, or None for the top-level package itself."""
    top, _, rest = module.partition(".")
    if top == "rewards":
        return "rewards"
    group = rest.partition(".")[0]
    return group if group in GROUPS else None


def may_import(importer: str | None, target: str | None) -> bool:
    """The direction rule between two modules' groups (None: the top-level `openrlhf_lora_sync`)."""
    if target is None:  # REPO_ROOT and the import-time filters: standard library only
        return True
    if importer is None:  # the top-level package imports none of its groups
        return False
    if "rewards" in (importer, target):
        return target == "rewards" or (importer, target) in (("rewards", "base"), ("tools", "rewards"))
    return GROUPS.index(target) <= GROUPS.index(importer)


def wrong_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if not may_import(group_of(module), group_of(target))
    }


def test_the_group_rule_finds_planted_violations(tmp_path):  # the negative control of the next test
    files = {
        "openrlhf_lora_sync/__init__.py": "",
        "openrlhf_lora_sync/base/__init__.py": "",
        "openrlhf_lora_sync/base/settings.py": "",
        "openrlhf_lora_sync/base/pins.py": "def f():\n    from openrlhf_lora_sync.sync import merge\n",
        "openrlhf_lora_sync/sync/__init__.py": "",
        "openrlhf_lora_sync/sync/merge.py": "from ..base import settings\nfrom openrlhf_lora_sync import x\n",
        "openrlhf_lora_sync/sync/sync.py": "def f():\n    from ..config.recipe import load_run\n",
        "openrlhf_lora_sync/config/__init__.py": "",
        "openrlhf_lora_sync/config/recipe.py": "from openrlhf_lora_sync.sync import merge\n",
        "openrlhf_lora_sync/config/preflight.py": "from ..patch import launch\nfrom . import recipe\n",
        "openrlhf_lora_sync/patch/__init__.py": "",
        "openrlhf_lora_sync/patch/launch.py": "from openrlhf_lora_sync.config import recipe\n",
        "openrlhf_lora_sync/testing/__init__.py": "from openrlhf_lora_sync.patch import launch\n",
        "openrlhf_lora_sync/testing/harness.py": "import openrlhf_lora_sync.tools.tool\n",
        "openrlhf_lora_sync/tools/__init__.py": "",
        "openrlhf_lora_sync/tools/tool.py": (
            "import rewards.reward\nfrom openrlhf_lora_sync.testing import harness\n"
        ),
        "rewards/__init__.py": "",
        "rewards/reward.py": (
            "from openrlhf_lora_sync.base import settings\nfrom openrlhf_lora_sync.sync import sync\n"
        ),
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    graph = import_graph([tmp_path / "openrlhf_lora_sync", tmp_path / "rewards"])
    assert "openrlhf_lora_sync" in graph["openrlhf_lora_sync.sync.merge"]  # the top level: allowed
    assert wrong_imports(graph) == {
        ("openrlhf_lora_sync.base.pins", "openrlhf_lora_sync.sync.merge"),
        ("openrlhf_lora_sync.sync.sync", "openrlhf_lora_sync.config.recipe"),
        ("openrlhf_lora_sync.config.preflight", "openrlhf_lora_sync.patch.launch"),
        ("openrlhf_lora_sync.testing.harness", "openrlhf_lora_sync.tools.tool"),
        ("rewards.reward", "openrlhf_lora_sync.sync.sync"),
    }


def test_every_module_sits_in_a_group_and_imports_go_one_way_between_groups():
    graph = import_graph()
    assert {name for name in graph if name.startswith("openrlhf_lora_sync") and group_of(name) is None} == {
        "openrlhf_lora_sync"
    }
    groups = {path.parent.name for path in PACKAGE_DIR.glob("*/__init__.py")}
    assert groups == set(GROUPS), groups
    # The rule is not vacuous: each group imports the one just before it somewhere.
    edges = {(group_of(module), group_of(target)) for module, targets in graph.items() for target in targets}
    assert {(later, earlier) for earlier, later in itertools.pairwise(GROUPS)} <= edges
    assert not wrong_imports(graph), sorted(wrong_imports(graph))


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


DOTTED_PATH = re.compile(r"openrlhf_lora_sync(?:\.[A-Za-z_]\w*)+")
TEXT_FOLDERS = ("patches", "rewards", "scripts", "tests", "docs", "recipes", "docker", ".ci")
TEXT_FILES = ("README.md", "pyproject.toml", "compose.yaml")
PLACEHOLDER = "openrlhf_lora_sync.tools.NAME"  # scripts/*.py and README: `python -m ...tools.NAME`


def resolves(dotted: str, package_dir: Path = PACKAGE_DIR) -> bool:
    """Whether `dotted` names a module (or package) of the package, or a top-level name defined in one."""
    parts = dotted.split(".")[1:]
    where = package_dir
    for index, part in enumerate(parts):
        if (where / part / "__init__.py").is_file():
            where = where / part
        elif (where / f"{part}.py").is_file():
            rest = parts[index + 1 :]
            if not rest:
                return True
            tree = ast.parse((where / f"{part}.py").read_text())
            defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            defined |= {
                target.id
                for node in tree.body
                if isinstance(node, ast.Assign)
                for target in node.targets
                if isinstance(target, ast.Name)
            }
            return len(rest) == 1 and rest[0] in defined
        else:
            return False
    return True


def test_every_dotted_package_path_in_the_repo_exists():
    assert resolves("openrlhf_lora_sync.patch.launch")
    assert resolves("openrlhf_lora_sync.sync.sync.sync_weights")
    # The negative controls: a module path from before the grouping, a name the module does not define.
    assert not resolves("openrlhf_lora_sync.launch")
    assert not resolves("openrlhf_lora_sync.patch.openrlhf_patch.no_such_name")
    files = [ROOT / name for name in TEXT_FILES]
    files += [path for folder in TEXT_FOLDERS for path in (ROOT / folder).rglob("*") if path.is_file()]
    named = {}
    for path in files:
        # This file's paths are the controls' and the planted packages'.
        if "__pycache__" in path.parts or path.suffix in (".png", ".jpg", ".pyc") or path == Path(__file__):
            continue
        for dotted in DOTTED_PATH.findall(path.read_text(errors="replace")):
            named.setdefault(dotted, str(path.relative_to(ROOT)))
    assert len(named) > 40
    missing = {
        dotted: where for dotted, where in named.items() if dotted != PLACEHOLDER and not resolves(dotted)
    }
    assert not missing, missing


@pytest.mark.parametrize("module", sorted(path.stem for path in (PACKAGE_DIR / "base").glob("*.py")))
def test_base_imports_only_the_standard_library_at_load(module):
    """settings is read by every process, pins runs before any virtual environment exists."""
    body = ast.parse((PACKAGE_DIR / "base" / f"{module}.py").read_text()).body
    top = {alias.name.split(".")[0] for node in body if isinstance(node, ast.Import) for alias in node.names}
    top |= {
        node.module.split(".")[0] for node in body if isinstance(node, ast.ImportFrom) and node.level == 0
    }
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top


def test_pyproject_lists_every_sub_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(path, PACKAGE_DIR) for path in PACKAGE_DIR.rglob("__init__.py")}
    assert found == {"openrlhf_lora_sync", *(f"openrlhf_lora_sync.{group}" for group in GROUPS)}
    assert listed == found | {"rewards"}, listed ^ (found | {"rewards"})


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
    assert (source / "patches" / PACKAGE_DIR.name / "base" / "versions.toml").is_symlink()
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
    installed = target / "openrlhf_lora_sync"
    modules = {str(path.relative_to(PACKAGE_DIR)) for path in PACKAGE_DIR.rglob("*.py")}
    assert modules <= {str(path.relative_to(installed)) for path in installed.rglob("*.py")}
    pins_file = installed / "base" / "versions.toml"
    assert pins_file.is_file() and not pins_file.is_symlink()
    probe = (
        "import openrlhf_lora_sync.base.pins as p, openrlhf_lora_sync.base.settings as s, rewards;"
        "print(p.__file__); print(p.supported_ranges()['openrlhf'], s.read('sync.bucket_mb'))"
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
    supported = tomllib.loads((ROOT / "versions.toml").read_text())["supported"]["openrlhf"]
    assert installed_at.startswith(str(target)) and versions == f"{supported} 128"
