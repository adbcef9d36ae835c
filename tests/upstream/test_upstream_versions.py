"""sync/upstream_versions.py's shims on the installed releases' real objects: each answers what the
installed OpenRLHF, vLLM or peft itself does. CI runs this on the default and the oldest stack, where each
shim takes its other branch (tests/upstream/test_openrlhf_contract.py checks which form each release has).

Covers: the deferred-attention predicate on vLLM's own layer classes, checkpoint names loaded into a
LoRA-wrapped layer by vLLM's own loader, the LoRA weights mapper on a real
model's hf_to_vllm_mapper, the IS-correction flag through OpenRLHF's own parser (recipe.py runs it), peft's
no-match error from a real get_peft_model. The shims inside a sync, a launch and a training run: the sync,
adapter-mode, config-check and learning-run tests on the oldest stack, which fail without them.
Does not cover: releases not installed here.
"""

from __future__ import annotations

import pytest
import torch
from openrlhf_lora_sync.config import recipe
from openrlhf_lora_sync.sync import upstream_versions
from peft import LoraConfig, get_peft_model
from torch import nn


def test_deferred_attention_layers_are_vllms_attention_classes():
    from vllm.model_executor.layers.attention import Attention, MLAAttention

    # Instances without __init__ (no engine config needed): the predicates look at the class only.
    for cls in (Attention, MLAAttention):
        assert upstream_versions.is_deferred_attention_layer(cls.__new__(cls)), cls
    # control: an ordinary layer is processed in order
    assert not upstream_versions.is_deferred_attention_layer(nn.Linear(2, 2))


def test_checkpoint_names_load_into_a_lora_wrapped_layer():
    """What a full sync of the base does to an adapter-mode engine, on vLLM's own loader and LoRA wrapper
    class (a plain linear layer wrapped, no engine): `proj.weight` lands in `proj.base_layer.weight`."""
    from vllm.lora.layers.base import BaseLayerWithLoRA
    from vllm.model_executor.models.utils import AutoWeightsLoader

    upstream_versions.backport_lora_layer_loading()
    wrapped = BaseLayerWithLoRA()
    wrapped.base_layer = nn.Linear(2, 2, bias=False)
    model = nn.Module()
    model.proj = wrapped
    weight = torch.arange(4.0).reshape(2, 2)
    loaded = AutoWeightsLoader(model).load_weights([("proj.weight", weight)])
    assert set(loaded) == {"proj.weight"} and torch.equal(wrapped.base_layer.weight.data, weight)
    # control: a name the wrapped layer lacks is still refused
    with pytest.raises(ValueError, match="no module or parameter named"):
        AutoWeightsLoader(model).load_weights([("proj.bias", torch.zeros(2))])


def test_lora_mapper_keeps_the_unstacked_names_and_the_renames():
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    full = Qwen2_5_VLForConditionalGeneration.hf_to_vllm_mapper
    lora = upstream_versions.lora_weights_mapper(full)
    name = "model.language_model.layers.0.self_attn.q_proj"
    # the LoRA variant renames the prefix as the full mapper does, and keeps q_proj (a LoRA module name)
    assert lora._map_name(name).endswith("layers.0.self_attn.q_proj")
    assert lora._map_name(name).split(".")[0] == full._map_name(name).split(".")[0] != "model"
    assert upstream_versions.lora_weights_mapper(None) is None


def _openrlhf_args(*flags: str):
    argv = ["--actor.model_name_or_path", "m", "--reward.remote_url", "rewards/math_answer.py", *flags]
    argv += [
        "--ds.lora.rank",
        "8",
        "--algo.advantage.estimator",
        "group_norm",
        "--rollout.n_samples_per_prompt",
        "4",
    ]
    return recipe.run_from_argv(argv, {}).args.algo.advantage


def test_is_correction_follows_openrlhfs_own_flag():
    advantage = _openrlhf_args()
    assert upstream_versions.is_correction_on(advantage) is False  # OpenRLHF's default: off
    # the installed release's own flag (0.11.2: a level; 0.11.0-0.11.1: a switch)
    on = (
        ["--algo.advantage.is_correction_level", "token"]
        if hasattr(advantage, "is_correction_level")
        else ["--algo.advantage.is_correction_enable"]
    )
    assert upstream_versions.is_correction_on(_openrlhf_args(*on)) is True


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


@pytest.mark.parametrize(
    "targets, no_match",
    [
        (["v_proj"], True),  # matches nothing: the error config_checks explains
        (["norm"], False),  # control: matched, but a type peft has no LoRA layer for (another ValueError)
    ],
)
def test_no_matching_module_error_is_told_apart(targets, no_match):
    torch.manual_seed(0)
    with pytest.raises(ValueError) as error:
        get_peft_model(_Tiny(), LoraConfig(r=2, target_modules=targets))
    assert upstream_versions.is_no_matching_module_error(error.value) is no_match
