"""scripts/bench_trainer_sync.py at its smallest size: upstream OpenRLHF's own broadcast_to_vllm and the
patch's full and delta syncs, in OpenRLHF's trainer and engine actors on a local Ray cluster.

Runs the benchmark as users do (a subprocess; bench-small, one bucket size, one repeat) and checks its
JSON line: every row, what each sent by its design (upstream one Ray call per tensor, the patch a few
buckets; a full sync the same bytes as upstream, a delta fewer), the trainer's peak RSS reported, and the
engine check after every row: stale before the sync (the negative control, the sync had something to do)
and matching the policy's own HF forward after it. Timings are printed, never asserted. Also: the 27B
estimate from two sizes of synthetic rows (its arithmetic and the published 27B config's counts).
Does not cover: the two larger sizes (`--sizes bench-small,bench,bench-large`: docs/performance.md's
scaling table, with its run time), GPUs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from openrlhf_lora_sync.sync.probe import PROBE_THRESHOLD
from openrlhf_lora_sync.tools.bench_trainer_sync import PCIE_GBPS, estimate_27b, model_27b

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_trainer_sync.py"
PATCH_ROWS = [
    f"{kind} {transport} 32 MiB" for transport in ("broadcast", "shm") for kind in ("full", "delta")
]


@pytest.mark.slow
def test_bench_trainer_sync_smallest_size():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "bench-small", "--bucket-mb", "32", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    print(run.stderr[-3000:])
    result = json.loads(run.stdout.strip().splitlines()[-1])
    (size,) = result["sizes"]
    rows = size["rows"]
    assert list(rows) == ["upstream", *PATCH_ROWS]
    threshold = PROBE_THRESHOLD["bfloat16"]
    for name, row in rows.items():
        assert row["diff_before"] > threshold, name  # stale before: the check can fail
        assert row["diff_after"] <= threshold, name
        assert row["seconds"] > 0 and row["peak_extra_bytes"] >= 0, name

    upstream = rows["upstream"]
    assert upstream["ray_calls"] == upstream["tensors"] > 100  # one update_weight call per parameter
    assert upstream["bytes"] == 2 * size["parameters"]  # every parameter, bf16
    for name in PATCH_ROWS:
        row = rows[name]
        assert row["ray_calls"] * 10 < upstream["ray_calls"], name
        if name.startswith("full"):
            assert row["mode"] == "full" and row["bytes"] == upstream["bytes"], name
        else:
            assert row["mode"] == "delta" and row["bytes"] < upstream["bytes"], name
    assert result["upstream_costs"] is None and result["estimate_27b"] is None  # one size: nothing to fit


def _row(calls: int, gib: float, seconds: float, bucket_mb=None) -> dict:
    return {"ray_calls": calls, "bytes": int(gib * 2**30), "seconds": seconds, "bucket_mb": bucket_mb}


def test_estimate_27b_from_two_sizes():
    # Synthetic costs: upstream 10 ms per call (one per tensor) plus 1 s per GiB; the patch's rows only
    # lend the estimate their calls besides the buckets (2 here).
    def size(gib: float, tensors: int) -> dict:
        buckets = math.ceil(gib * 1024 / 128)
        return {
            "rows": {
                "upstream": _row(tensors, gib, 0.01 * tensors + gib),
                "full broadcast 128 MiB": _row(buckets + 2, gib, 9.0, 128),
                "delta broadcast 128 MiB": _row(buckets + 2, gib, 9.0, 128),
            }
        }

    assert estimate_27b({"sizes": [size(2.0, 400)]}) is None  # one size: no fit
    estimate = estimate_27b({"sizes": [size(0.5, 200), size(2.0, 400)]})
    assert estimate["seconds_per_call"] == pytest.approx(0.01)
    assert estimate["seconds_per_gib"] == pytest.approx(1.0)

    model = model_27b()
    assert 1000 < model["tensors"] < 2000  # Qwen3.5-27B's parameter tensors, vision tower included
    assert 50e9 < model["full_bytes"] < 60e9  # 27.4B parameters in bf16
    assert 0.8 * model["full_bytes"] < model["delta_bytes"] < model["full_bytes"]  # all language linears

    rows = estimate["rows"]
    assert rows["upstream"]["ray_calls"] == model["tensors"]
    assert rows["full"]["ray_calls"] == math.ceil(model["full_bytes"] / (128 << 20)) + 2
    assert rows["delta"]["ray_calls"] == math.ceil(model["delta_bytes"] / (128 << 20)) + 2
    assert rows["delta"]["bytes"] == model["delta_bytes"]
    for row in rows.values():
        assert row["calls_s"] == pytest.approx(0.01 * row["ray_calls"])
        assert row["pcie_s"] == pytest.approx(row["bytes"] / (PCIE_GBPS * 1e9))
        assert row["x_upstream"] == pytest.approx(rows["upstream"]["seconds"] / row["seconds"])
