"""OpenRLHF's own test suite, which its wheel ships as the top-level `tests` package, passes under the patch
every test it passes without it.

Covers: the installed release's suite run three times in subprocesses: as shipped, with the patch applied
before collection (testing/patched_pytest.py), and, as the negative control, with the patch plus a global
side effect a careless patch could leave (torch's default dtype left at bf16), which the comparison must
catch. Outcomes are compared per test from each run's JUnit XML. On CPU the patch turns some of the
suite's failures into passes (its CPU stand-ins answer the CUDA calls those tests make); the test prints
them. Does not cover: the suite's behaviour on GPUs, or OpenRLHF's repository tests that the wheel leaves
out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

import pytest

PATCHED = "openrlhf_lora_sync.testing.patched_pytest"
# The negative control: the patch, then a process-wide change that breaks upstream's numerics.
CARELESS_PLUGIN = """
def pytest_configure(config):
    import torch
    from openrlhf_lora_sync.patch.openrlhf_patch import apply

    apply()
    torch.set_default_dtype(torch.bfloat16)
"""


def own_suite() -> Path:
    """The folder of OpenRLHF's shipped tests, found through the installed distribution's file list (the
    distribution is `openrlhf` or a nightly's `openrlhf-nightly`)."""
    name = packages_distributions()["openrlhf"][0]
    files = distribution(name).files or ()
    tests = [f for f in files if f.parts[0] == "tests" and f.name.startswith("test_") and f.suffix == ".py"]
    if not tests:
        pytest.skip(f"the installed {name} ships no tests/ in its wheel")
    return Path(tests[0].locate()).parent


def passed_tests(tmp_path: Path, label: str, *plugin_args: str, env_path: str = "") -> set[str]:
    """The ids of the tests one run of the own suite passed (its rootdir and config kept apart from ours)."""
    run_dir = tmp_path / label
    run_dir.mkdir()
    ini = run_dir / "pytest.ini"
    ini.write_text("[pytest]\n")
    report = run_dir / "report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    command += ["-c", str(ini), "--rootdir", str(run_dir), *plugin_args, str(own_suite())]
    env = dict(os.environ)
    if env_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env_path, env.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=600)
    # 0: all passed, 1: some failed (the suite has CPU failures of its own); anything else: it did not run.
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode in (0, 1), f"{label}: exit {done.returncode}\n{output}"
    passed = set()
    for case in ET.parse(report).getroot().iter("testcase"):
        if not any(child.tag in ("failure", "error", "skipped") for child in case):
            passed.add(f"{case.get('classname')}::{case.get('name')}")
    return passed


def test_openrlhfs_own_suite_passes_under_the_patch_what_it_passes_without(tmp_path):
    shipped = passed_tests(tmp_path, "shipped")
    patched = passed_tests(tmp_path, "patched", "-p", PATCHED)
    (tmp_path / "careless_patch.py").write_text(CARELESS_PLUGIN)
    careless = passed_tests(tmp_path, "careless", "-p", "careless_patch", env_path=str(tmp_path))
    print(
        f"OpenRLHF's own suite ({own_suite()}): {len(shipped)} passed as shipped, {len(patched)} under the "
        f"patch, {len(careless)} under the careless control; passing only under the patch: "
        f"{sorted(patched - shipped)}"
    )
    assert shipped, "the own suite passed nothing as shipped: the run itself is broken"
    assert not shipped - patched, f"the patch broke upstream's own tests: {sorted(shipped - patched)}"
    # The comparison can fail: the control's side effect breaks tests the shipped run passes.
    assert shipped - careless, (
        "the careless control broke nothing: the comparison would not notice a harmful patch"
    )
