"""The LoRA policies, target patterns and training nudges the tests and benchmarks share.

Covers:
- `language_linears(names)`: a peft `target_modules` pattern for the named linear layers of the language
  model, in the VLM and the text-only families alike, never the vision tower's (Qwen2.5-VL's vision MLPs
  share the bare names); LANGUAGE_LINEARS (every one, Qwen3.5's linear attention included),
  ATTENTION_AND_MLP_LINEARS (Qwen3.5's linear attention left out) and QV_ONLY;
- `lora_policy(model_dir, target_modules, ...)`: a peft policy on a checkpoint directory, adapters fp32
  (peft's default) with both factors random (B non-zero, as after training: far enough from the base for
  a logprob check to bite), seeded;
- `nudge_adapters(policy, seed)`: a stand-in training step that moves every lora_B a little, so each
  delta sync carries new weights.
Does not cover: OpenRLHF's own Actor under DeepSpeed (cpu_deepspeed.lora_policy) or a real optimizer
step (tests/conftest.py's training_step; cpu_deepspeed.train_step).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")  # Qwen3.5's
NUDGE_SCALE = 1e-3


def language_linears(names: tuple[str, ...] = ATTENTION_AND_MLP + LINEAR_ATTENTION) -> str:
    """A peft target_modules regex (fullmatched against module names) for the language model's `names`."""
    return rf"^(?!.*visual).*\.({'|'.join(names)})$"


LANGUAGE_LINEARS = language_linears()
ATTENTION_AND_MLP_LINEARS = language_linears(ATTENTION_AND_MLP)  # Qwen3.5's linear attention left out
QV_ONLY = language_linears(("q_proj", "v_proj"))


def lora_policy(
    model_dir: str | Path,
    target_modules: str | list[str] = LANGUAGE_LINEARS,
    *,
    dtype: str = "auto",
    seed: int = 0,
    **lora_options,
):
    """peft's get_peft_model on the checkpoint in `model_dir` (a VLM when its config has a vision_config),
    loaded in `dtype` ("auto": the checkpoint's own), with LoraConfig(r=8, lora_alpha=16, random init)
    unless `lora_options` say otherwise (r, lora_alpha, use_dora, modules_to_save, rank_pattern, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = json.loads((Path(model_dir) / "config.json").read_text())
    auto_cls = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    base = auto_cls.from_pretrained(model_dir, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    torch.manual_seed(seed)
    options = {"r": 8, "lora_alpha": 16, "init_lora_weights": False, **lora_options}
    return get_peft_model(base, LoraConfig(target_modules=target_modules, **options))


def nudge_adapters(policy, seed: int, scale: float = NUDGE_SCALE) -> None:
    """A stand-in training step: every lora_B moves by seeded noise of `scale`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
