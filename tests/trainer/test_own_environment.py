"""The run script in a user's own environment: which Python `scripts/run_grpo_lora.sh` runs.

Covers: LORA_SYNC_PYTHON wins over .venv/ (control: unset, the checkout's .venv/ is used, no such line);
in a checkout without .venv/ (an exported copy), the active environment's `python` is used when it has
OpenRLHF, vLLM and this repo. Each through `--dry-run`, which renders the recipe with that Python.
Does not cover: a checkout without .venv/ whose `python` lacks them (the script then builds .venv/:
minutes; scripts/setup_env.sh is tested by running it in CI), the run itself in another environment
(scripts/test_upstream.sh runs test_cpu_run.py with LORA_SYNC_PYTHON on the oldest stack).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def wrapper(directory: Path) -> Path:
    """A `python` that leaves a mark and runs this test's interpreter (which has OpenRLHF, vLLM, the repo)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "python"
    path.write_text(f'#!/bin/sh\ntouch "{directory}/used"\nexec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return path


def dry_run(checkout: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(checkout / "scripts" / "run_grpo_lora.sh"), "smoke-cpu", "--dry-run"],
        capture_output=True, text=True, env=env, cwd=checkout, timeout=300,
    )  # fmt: skip


def test_lora_sync_python_wins_over_the_venv(tmp_path):
    python = wrapper(tmp_path / "bin")
    done = dry_run(ROOT, {**os.environ, "LORA_SYNC_PYTHON": str(python)})
    assert done.returncode == 0, done.stderr
    assert f"using {python}" in done.stderr and (tmp_path / "bin" / "used").exists()
    # control: unset, the checkout's .venv/ runs it and the wrapper is never called
    (tmp_path / "bin" / "used").unlink()
    env = {k: v for k, v in os.environ.items() if k != "LORA_SYNC_PYTHON"}
    done = dry_run(ROOT, env)
    assert done.returncode == 0 and "using " not in done.stderr and not (tmp_path / "bin" / "used").exists()


def test_without_a_venv_the_active_environments_python_runs(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive, check=True)
    assert not (checkout / ".venv").exists()
    python = wrapper(tmp_path / "bin")
    # the copy's own package first, as `pip install --no-deps -e .` there would put it
    env = {
        **os.environ,
        "PATH": f"{python.parent}:{os.environ['PATH']}",
        "PYTHONPATH": f"{checkout / 'patches'}",
    }
    env.pop("LORA_SYNC_PYTHON", None)
    done = dry_run(checkout, env)
    assert done.returncode == 0, done.stderr
    assert f"using {python}" in done.stderr and (tmp_path / "bin" / "used").exists()
    assert not (checkout / ".venv").exists()  # nothing was built
