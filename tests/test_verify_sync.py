"""scripts/verify_sync.py as a user runs it: one JSON line, exit 0 iff vLLM matches the merged policy.

Covers: a VL checkpoint with a processor (image prompt checked too), a checkpoint without tokenizer
files, and --skip-sync, which must fail (the check can fail); the same with --mode adapter (vLLM
LoRA with the adapter delivered in memory) for every family. Each run is a fresh process with its own
vLLM engine, as on a user's machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from openrlhf_lora_sync.sync import adapter_mode
from openrlhf_lora_sync.testing.tiny_models import FAMILIES

ROOT = Path(__file__).resolve().parent.parent


def run_verify(*args) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "verify_sync.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    json_lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert json_lines, f"no JSON line; stderr tail:\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(json_lines[-1])


def test_vl_checkpoint_passes_with_image_checked(tiny_model_dir):
    code, result = run_verify("--model", tiny_model_dir("qwen2_5_vl"))
    assert code == 0 and result["ok"] and result["image_checked"]
    assert result["max_abs_logprob_diff"] <= result["tolerance"] < result["before_diff"]
    assert result["sync"]["mode"] == "full"


def test_checkpoint_without_tokenizer_files(tiny_model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir("qwen3") / name, bare / name)
    code, result = run_verify("--model", bare)
    assert code == 0 and result["ok"] and not result["image_checked"]


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_skip_sync_reports_not_ok(family, tiny_model_dir):
    code, result = run_verify("--model", tiny_model_dir(family), "--skip-sync")
    assert code == 1 and not result["ok"] and result["sync"] is None
    assert result["max_abs_logprob_diff"] > 10 * result["tolerance"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verify_sync_adapter_mode_passes(family, tiny_model_dir):
    assert FAMILIES[family].name in adapter_mode.SUPPORTED_MODEL_TYPES
    code, result = run_verify("--model", tiny_model_dir(family), "--mode", "adapter")
    assert code == 0 and result["ok"] and result["mode"] == "adapter", result
    assert result["max_abs_logprob_diff"] <= result["tolerance"] < result["before_diff"] / 10
    assert result["image_checked"] == FAMILIES[family].is_vlm
    assert result["sync"]["mode"] == "adapter"


def test_verify_sync_adapter_mode_skip_sync_fails(tiny_model_dir):
    code, result = run_verify("--model", tiny_model_dir("qwen3"), "--mode", "adapter", "--skip-sync")
    assert code == 1 and not result["ok"] and result["sync"] is None
    assert result["max_abs_logprob_diff"] > 10 * result["tolerance"]
