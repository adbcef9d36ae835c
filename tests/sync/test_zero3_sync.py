"""Trainer-side merge under real DeepSpeed ZeRO-3: world size 2 (gloo, CPU) syncs what world size 1 does.

Covers: `sync_units` + `iter_effective_checkpoint_tensors` on a peft-wrapped tiny Qwen2.5-VL policy
(LoRA on the language model's q_proj/v_proj/up_proj, random non-zero B) wrapped by `deepspeed.initialize`
with ZeRO stage 3 and no persistent parameters, run as 1 and as 2 real processes (DS_ACCELERATOR=cpu,
gloo). Each run asserts its parameters really are ZeRO-3 parameters, released outside the gather, and on
world size 2 sharded; that the gather is collective (every rank iterates); and that a second sync
returns the same tensors (nothing was merged in place). The parent then checks that both runs give the
same names and bitwise-equal tensors, that the names are exactly the HF checkpoint's on disk, and that
the values equal peft's own `merge_and_unload()` without DeepSpeed; negative controls show the
comparison catches a missing LoRA delta and a corrupted tensor. The same workers also collect what the
adapter sync mode sends (adapter_mode.py): the adapter alone, which must equal on both world sizes what
peft saves (names and values), and the base weights with the adapters switched off (its resync after a
level-2 wake), which must equal the checkpoint on disk, unmerged.

Does not cover: bf16 policies, CPU/NVMe offload, `modules_to_save`, what is sent (plan.py), packing and
transport (bucket.py, transport.py), or the engine side; nor DeepSpeed's default coalesced gather, which
races on gloo (see the config below), so the workers gather sequentially. Workers are subprocesses
running this file, because spawned multiprocessing children cannot re-import a test module loaded with
pytest's importlib mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from openrlhf_lora_sync.sync.transport import free_port
from openrlhf_lora_sync.testing.cpu_deepspeed import process_env

FAMILY = "qwen2_5_vl"
LORA_MODULES = ("q_proj", "v_proj", "up_proj")
ADAPTER_SEED = 1234
# The gather is a copy and every worker runs the same fp32 ops on one thread: ws1 and ws2 must match
# bit for bit. peft's merge_and_unload does the same W + delta in fp32, in another process.
REFERENCE_ATOL = 1e-6
# init_lora_weights=False draws B at random, so a missing delta moves weights by far more than this.
MIN_LORA_DELTA = 1e-3
WORKER_TIMEOUT_S = 600


# ---------------------------------------------------------------------------------------------------
# Worker: runs in its own process, one per rank.
# ---------------------------------------------------------------------------------------------------


def _partition_stats(params) -> dict[str, int]:
    return {
        "params": len(params),
        "zero3": sum(hasattr(p, "ds_id") for p in params),
        # ZeRO-3 frees the full tensor outside a gather; a persistent param would keep it.
        "released": sum(hasattr(p, "ds_id") and p.data.numel() == 0 for p in params),
        "sharded": sum(hasattr(p, "ds_id") and p.ds_tensor.numel() < p.ds_numel for p in params),
        "local_numel": sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_id")),
        "full_numel": sum(p.ds_numel for p in params if hasattr(p, "ds_id")),
    }


def _sync_once(engine) -> dict[str, torch.Tensor]:
    from openrlhf_lora_sync.sync.merge import iter_effective_checkpoint_tensors, sync_units

    synced: dict[str, torch.Tensor] = {}
    units = sync_units(engine.module)
    assert sum(unit.has_lora for unit in units) > 0, "no LoRA units: the adapter did not load"
    for _unit, tensors in iter_effective_checkpoint_tensors(engine.module, units, torch.float32):
        duplicated = synced.keys() & tensors.keys()
        assert not duplicated, f"names synced twice: {sorted(duplicated)}"
        synced.update(tensors)
    return synced


def run_worker(model_dir: str, adapter_dir: str, out_dir: str) -> None:
    """One rank: load base + adapter, wrap in ZeRO-3, sync twice, rank 0 saves the tensors."""
    import deepspeed
    from openrlhf_lora_sync.config.adapter_check import load_checked_adapter
    from transformers import AutoModelForImageTextToText

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend="gloo")
    out = Path(out_dir)

    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model = load_checked_adapter(base, adapter_dir, is_trainable=True)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            # 0: no parameter is kept whole, so every module (biases and norms too) is gathered.
            "stage3_param_persistence_threshold": 0,
            # DeepSpeed's default (coalesced) gathering on purpose: merge.py must be right under it.
        },
        "zero_allow_untested_optimizer": True,
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    params = list(engine.module.parameters())
    stats = _partition_stats(params)
    # Without these the test would pass trivially, on full unpartitioned tensors.
    assert stats["zero3"] == stats["params"], stats
    assert stats["released"] == stats["params"], stats
    if world_size > 1:
        assert stats["sharded"] == stats["params"], stats
        assert stats["local_numel"] < stats["full_numel"], stats

    first = _sync_once(engine)
    # Gathers are released again: the sync must not leave full copies of the model behind.
    assert _partition_stats(params)["released"] == stats["params"]
    # A second sync sees the same weights: the merge was out of place.
    second = _sync_once(engine)
    assert first.keys() == second.keys()
    unequal = [name for name in first if not torch.equal(first[name], second[name])]
    assert not unequal, f"second sync differs (merged in place?): {unequal[:5]}"
    from openrlhf_lora_sync.sync.adapter_mode import adapters_switched_off, lora_tensors

    adapter = dict(lora_tensors(engine.module, torch.float32))
    with adapters_switched_off(engine.module):
        unmerged = _sync_once(engine)

    (out / f"rank{rank}.json").write_text(json.dumps({"world_size": world_size, **stats}))
    if rank == 0:
        torch.save(first, out / "synced.pt")
        torch.save(adapter, out / "adapter.pt")
        torch.save(unmerged, out / "unmerged.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------------------------------


def _run_world(world_size: int, model_dir: Path, adapter_dir: Path, out_dir: Path) -> dict[str, torch.Tensor]:
    """Start `world_size` worker processes on this file and return rank 0's synced tensors."""
    out_dir.mkdir(parents=True)
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = process_env(rank, world_size, port)
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below, after the process ends
        cmd = [sys.executable, __file__, "--worker", str(model_dir), str(adapter_dir), str(out_dir)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    failed = []
    try:
        for rank, (proc, _log) in enumerate(procs):
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                failed.append(rank)
                break  # a dead rank leaves the others blocked in a collective
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        tails = "\n".join(
            f"--- rank {rank} ---\n" + (out_dir / f"rank{rank}.log").read_text()[-4000:] for rank in failed
        )
        pytest.fail(f"world size {world_size}: worker failed\n{tails}")
    for rank in range(world_size):
        stats = json.loads((out_dir / f"rank{rank}.json").read_text())
        print(f"ws{world_size} rank {rank}: {stats}")
    return torch.load(out_dir / "synced.pt")


def tensor_diffs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[list[str], float]:
    """(problems, max |got - want|): missing/extra names, shape or dtype mismatches, and the largest diff."""
    problems = [f"missing {name}" for name in sorted(want.keys() - got.keys())]
    problems += [f"unexpected {name}" for name in sorted(got.keys() - want.keys())]
    worst = 0.0
    for name in sorted(got.keys() & want.keys()):
        a, b = got[name], want[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
            continue
        worst = max(worst, (a.double() - b.double()).abs().max().item())
    return problems, worst


def _check_close(got, want, atol: float, what: str) -> float:
    problems, worst = tensor_diffs(got, want)
    assert not problems, f"{what}: {problems[:10]}"
    assert worst <= atol, f"{what}: max |diff| {worst:.3g} > {atol:g}"
    return worst


def _make_adapter(model_dir: Path, adapter_dir: Path) -> None:
    from openrlhf_lora_sync.testing.policies import language_linears, lora_policy

    policy = lora_policy(model_dir, language_linears(LORA_MODULES), dtype="float32", seed=ADAPTER_SEED)
    policy.save_pretrained(adapter_dir)


def _peft_merged_reference(model_dir: Path, adapter_dir: Path, out_dir: Path) -> dict[str, torch.Tensor]:
    """peft's merge_and_unload, saved by transformers: values and names independent of merge.py."""
    from openrlhf_lora_sync.config.adapter_check import load_checked_adapter
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    merged = load_checked_adapter(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    return load_file(str(out_dir / "model.safetensors"))


@pytest.mark.slow
def test_zero3_world_size_2_syncs_same_tensors_as_world_size_1(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    started = time.monotonic()
    model_dir = Path(tiny_model_dir(FAMILY))
    adapter_dir = tmp_path / "adapter"
    _make_adapter(model_dir, adapter_dir)

    ws1 = _run_world(1, model_dir, adapter_dir, tmp_path / "ws1")
    ws2 = _run_world(2, model_dir, adapter_dir, tmp_path / "ws2")
    reference = _peft_merged_reference(model_dir, adapter_dir, tmp_path / "merged")
    on_disk = load_file(str(model_dir / "model.safetensors"))

    # Names are exactly what vLLM loads: the checkpoint's, not peft's or transformers' runtime names.
    assert ws1.keys() == on_disk.keys(), sorted(ws1.keys() ^ on_disk.keys())[:10]
    ws_diff = _check_close(ws2, ws1, 0.0, "ws2 vs ws1")
    ref_diffs = {
        ws: _check_close(got, reference, REFERENCE_ATOL, f"{ws} vs peft merge")
        for ws, got in (("ws1", ws1), ("ws2", ws2))
    }

    # Negative control 1: the base weights (LoRA delta dropped) must fail the same comparison, and by a
    # wide margin, only on the LoRA-targeted modules.
    # The checkpoint names the language model `model.layers.*` (transformers renames it at load time);
    # the vision tower's up_proj is not targeted.
    lora_names = {
        n
        for n in on_disk
        if n.startswith("model.layers.") and n.endswith(tuple(f".{m}.weight" for m in LORA_MODULES))
    }
    assert len(lora_names) == 2 * len(LORA_MODULES), sorted(lora_names)  # 2 decoder layers
    _, base_diff = tensor_diffs(on_disk, ws2)
    assert base_diff > MIN_LORA_DELTA
    per_name = {n: (ws2[n] - on_disk[n]).abs().max().item() for n in on_disk}
    assert all(per_name[n] > MIN_LORA_DELTA for n in lora_names), "a LoRA target was synced without delta"
    assert all(per_name[n] == 0.0 for n in per_name.keys() - lora_names), "a non-LoRA weight changed"
    # Negative control 2: one corrupted element in one tensor, and a dropped name, are both reported.
    corrupted = dict(ws2)
    victim = sorted(lora_names)[0]
    corrupted[victim] = ws2[victim].clone()
    corrupted[victim].view(-1)[0] += 1e-5
    assert tensor_diffs(corrupted, ws1)[1] > REFERENCE_ATOL
    dropped = {n: t for n, t in ws2.items() if n != victim}
    assert tensor_diffs(dropped, ws1)[0] == [f"missing {victim}"]

    # Adapter sync mode: the adapter as peft saved it (names and values), and the base unmerged.
    saved_adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for ws in ("ws1", "ws2"):
        _check_close(torch.load(tmp_path / ws / "adapter.pt"), saved_adapter, 0.0, f"{ws} adapter vs peft's")
        _check_close(torch.load(tmp_path / ws / "unmerged.pt"), on_disk, 0.0, f"{ws} base vs checkpoint")

    print(
        f"{len(ws1)} tensors; max |ws2-ws1| {ws_diff:.3g}; max |ws-peft| {ref_diffs}; "
        f"max |base-ws2| {base_diff:.3g}; {time.monotonic() - started:.1f}s"
    )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        run_worker(*sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker MODEL_DIR ADAPTER_DIR OUT_DIR")
