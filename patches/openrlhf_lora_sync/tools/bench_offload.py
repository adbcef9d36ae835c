#!/usr/bin/env python3
"""Benchmark: the trainer base offload's cost (trainer.offload_params, offload.py) on CPU, per training
step and per sync, as a ratio to the same run without it.

    python scripts/bench_offload.py [--scale bench|tiny] [--steps 5] [--syncs 3] [--length 64]

Hardware: CPU only (DeepSpeed's CPU accelerator, ZeRO-3, world size 1, gloo; the script starts itself as
that worker process). The default `bench` scale (Qwen2.5-VL-shaped, 320M parameters, tiny_models.py,
LoRA r=64 on every language-model linear, bf16 policy) takes a few minutes on 2 cores, --scale tiny well
under one; its measured times and ratios: docs/memory.md, "What it costs in step time".

What it builds: both policies through OpenRLHF's own code (cpu_deepspeed.prepared_lora_actor: `Actor(...,
ds_config=strategy.get_ds_train_config())` and `strategy.prepare`), one with LORA_SYNC_OFFLOAD_PARAMS=1
and one without, in the same process, then alternates them so that load on a shared machine hits both:
- step: OpenRLHF's Actor forward on 2 sequences of --length tokens, backward and optimizer step (torch's
  AdamW in both: cpu_deepspeed.use_torch_adam);
- sync: the trainer side of a full weight sync (merge.iter_effective_checkpoint_tensors over every sync
  unit: ZeRO-3 gather, LoRA merge, checkpoint names, bf16) and of a delta sync (the LoRA units only);
  the engine's side does not depend on where the trainer keeps its parameters (scripts/bench_sync.py).
Prints medians per mode and their ratio (offload / resident), then one JSON line; asserts nothing on time.

Does not cover what CPU numbers cannot show: on the CPU accelerator the device is the host, so ZeRO-3
fetches an offloaded partition without copying it; these ratios are the offload's code path (flat host
buffers, the optimizer on the host path), not the PCIe transfer a GPU host pays on every forward and
backward (each rank's bf16 shard, 2P/N bytes, host to device per pass: an estimate there, see
scripts/memory_budget.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from openrlhf_lora_sync.testing.cpu_deepspeed import process_env

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 64
MODES = ("offload", "resident")


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def _sync_trainer_side(module, lora_only: bool) -> None:
    from openrlhf_lora_sync.sync.merge import iter_effective_checkpoint_tensors, sync_units

    units = [unit for unit in sync_units(module) if unit.has_lora or not lora_only]
    for _unit, tensors in iter_effective_checkpoint_tensors(module, units, torch.bfloat16):
        del tensors


def run_worker(model_dir: str, steps: int, syncs: int, length: int) -> dict:
    from openrlhf_lora_sync.patch import offload, openrlhf_patch
    from openrlhf_lora_sync.sync.probe import policy_vocab_size
    from openrlhf_lora_sync.testing import cpu_deepspeed

    cpu_deepspeed.init_cpu_process()
    openrlhf_patch.apply()
    cpu_deepspeed.use_torch_adam()
    policies, load_seconds = {}, {}  # built in this order: the first load also warms the file cache
    for mode in MODES:
        os.environ[offload.ENV] = "1" if mode == "offload" else "0"
        strategy = cpu_deepspeed.strategy()
        start = time.perf_counter()
        policies[mode] = (
            strategy,
            *cpu_deepspeed.prepared_lora_actor(model_dir, strategy, LORA_TARGETS, 1e-5, 1.0, LORA_RANK),
        )
        load_seconds[mode] = time.perf_counter() - start
    vocab = policy_vocab_size(policies["resident"][1].model.module)
    times = {mode: {"step": [], "full_sync": [], "delta_sync": []} for mode in MODES}
    for repeat in range(1 + max(steps, syncs)):  # repeat 0 warms both up and is not counted
        for mode in MODES:
            strategy, model, optimizer, scheduler = policies[mode]
            module = model.model.module
            row = {
                "step": _timed(
                    cpu_deepspeed.train_step, model, strategy, optimizer, scheduler, vocab, repeat, length
                ),
                "full_sync": _timed(_sync_trainer_side, module, False),
                "delta_sync": _timed(_sync_trainer_side, module, True),
            }
            if repeat:
                for name, seconds in row.items():
                    if len(times[mode][name]) < (steps if name == "step" else syncs):
                        times[mode][name].append(seconds)
    medians = {
        mode: {name: statistics.median(values) for name, values in rows.items()}
        for mode, rows in times.items()
    }
    return {"load_seconds": load_seconds, "medians": medians, "samples": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=("bench", "tiny"), default="bench", help="tiny_models.py scale")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per mode (median)")
    parser.add_argument("--syncs", type=int, default=3, help="timed syncs per mode (median)")
    parser.add_argument("--length", type=int, default=64, help="tokens per training sequence")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the worker (OMP_NUM_THREADS)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = run_worker(args.worker[0], args.steps, args.syncs, args.length)
        Path(args.worker[1]).write_text(json.dumps(result))
        return 0

    from openrlhf_lora_sync.testing.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        model_dir = build_tiny_model("qwen2_5_vl", Path(tmp) / "model", scale=args.scale)
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--worker", str(model_dir), str(out), "--steps", str(args.steps)]
        command += ["--syncs", str(args.syncs), "--length", str(args.length)]
        env = process_env(OMP_NUM_THREADS=str(args.threads))
        started = time.monotonic()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-6000:], file=sys.stderr)
            return done.returncode
        result = json.loads(out.read_text())
    medians = result["medians"]
    print(f"scale {args.scale}, LoRA r{LORA_RANK}, {args.length}-token sequences, {args.threads} thread(s)")
    print(f"{'':12s} {'offload s':>10s} {'resident s':>10s} {'ratio':>6s}")
    ratios = {}
    for name in ("step", "full_sync", "delta_sync"):
        offloaded, resident = medians["offload"][name], medians["resident"][name]
        ratios[name] = offloaded / resident
        print(f"{name:12s} {offloaded:10.3f} {resident:10.3f} {ratios[name]:6.2f}")
    summary = {
        "scale": args.scale,
        "ratios": ratios,
        **result,
        "seconds": time.monotonic() - started,
        "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
