"""tools/gpu_bench.py without a GPU: the same code at tiny sizes, run as its header says to run it on a bare
GPU host (`PYTHONPATH=patches python -m ...`, with vLLM, Ray, DeepSpeed and OpenRLHF hidden), prints its
JSON line.

Checks that every figure is there and positive, that the GPU figures say "not run" on a CPU, and that the
layer merge it times is the patch's merge: equal to peft's merge_and_unload on the full-attention layer
(bf16: within one rounding step), while far from the unmerged base (the negative control).
Timings are printed, never asserted. Does not cover: GPU numbers (run the script on a GPU host).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# What a bare GPU host lacks: importing any of them fails, as it would there.
NOT_ON_A_BARE_GPU_HOST = ("vllm", "ray", "deepspeed", "openrlhf", "datasets", "math_verify", "wandb")
BARE_HOST_RUN = """
import runpy, sys
for name in sys.argv.pop(1).split(","):
    sys.modules[name] = None
runpy.run_module("openrlhf_lora_sync.tools.gpu_bench", run_name="__main__", alter_sys=True)
"""
# One bf16 rounding step of weights of size ~1 (peft rounds its own sum the same way or one step off).
BF16_STEP = 2**-7


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback; on a GPU host run the script itself")
def test_gpu_bench_runs_on_cpu_at_tiny_sizes():
    run = subprocess.run(
        [sys.executable, "-c", BARE_HOST_RUN, ",".join(NOT_ON_A_BARE_GPU_HOST), "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": "patches"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(result)
    assert result["gpu_figures"] == "not run"
    for direction in ("h2d_gbps", "d2h_gbps"):
        assert result[direction] and all(v > 0 for v in result[direction].values()), result
    assert set(result["merge_s"]) == {"linear_attention", "full_attention"}
    assert all(s > 0 for s in result["merge_s"].values()) and result["merge_model_estimate_s"] > 0
    assert result["layer_dims"]["lora_rank"] == 64
    assert result["merge_vs_peft"] <= BF16_STEP, result
    assert result["delta_vs_base"] > 10 * BF16_STEP, result  # the control: the merge changed the weights
