"""scripts/export_merged.py on tiny random checkpoints: the merged model computes the peft model's logits.

Covers, for Qwen2.5-VL (with its processor) and the text-only Qwen3: an adapter with random non-zero A and
B (init_lora_weights=False) on language-model linears is exported through the CLI entry point with a small
max_shard_size; the exported checkpoint loads with transformers and its logits equal the unmerged peft
model's (fp32 both sides); negative control: the base model's logits do not. Also: the shard index and
several shards exist, the tensor names are the base checkpoint's (what vLLM's loader reads), the
tokenizer / processor / chat template / generation config are copied and load, and an existing --out is
not replaced without --overwrite. With --dtype bfloat16 every stored tensor is bf16 and equals peft's
fp32 merge rounded once.

Does not cover: vision inputs (the adapter is on the language model), hub ids (only directories here).
"""

from __future__ import annotations

import json

import pytest
import torch
from openrlhf_lora_sync.tools import export_merged
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

# fp32 merge vs peft's unmerged fp32 forward: the same sums in another order.
LOGITS_ATOL = 1e-4
TARGETS = ["q_proj", "v_proj", "o_proj"]  # language-model-only names in both families


def _tensor_names(directory) -> set[str]:
    names = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as handle:
            names.update(handle.keys())
    return names


def _logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_exported_model_computes_the_peft_models_logits(family, tiny_model_dir, tmp_path):
    base_dir = tiny_model_dir(family)
    config = AutoConfig.from_pretrained(base_dir)
    model_class = export_merged.model_class(config)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        model_class.from_pretrained(base_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False),
    )
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    input_ids = torch.randint(0, 256, (2, 24))
    want = _logits(peft_model, input_ids)
    with peft_model.disable_adapter():
        base_logits = _logits(peft_model, input_ids)

    out = tmp_path / "merged"
    argv = ["--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out)]
    assert export_merged.main([*argv, "--max-shard-size", "200KB"]) == 0

    exported = model_class.from_pretrained(out, dtype=torch.float32)
    got = _logits(exported, input_ids)
    assert (got - want).abs().max().item() < LOGITS_ATOL
    assert (base_logits - want).abs().max().item() > 100 * LOGITS_ATOL  # the adapter changes the logits

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert _tensor_names(out) == _tensor_names(base_dir) == set(index["weight_map"])
    assert exported.config.dtype == torch.float32 == config.dtype
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (base_dir / name).read_bytes(), name
    if family == "qwen2_5_vl":
        assert (out / "processor_config.json").is_file()
        assert AutoProcessor.from_pretrained(out).image_processor is not None
    else:
        assert AutoTokenizer.from_pretrained(out).chat_template

    assert export_merged.main(argv) == 2  # an existing --out without --overwrite
    assert export_merged.main([*argv, "--overwrite"]) == 0
    assert not (out / "model.safetensors.index.json").exists()  # 5GB default: one shard
    assert (
        _logits(model_class.from_pretrained(out, dtype=torch.float32), input_ids) - want
    ).abs().max() < LOGITS_ATOL


def test_dtype_cast_after_the_fp32_merge(tiny_model_dir, tmp_path):
    """--dtype bfloat16: every tensor is stored in bf16 and equals the fp32 merge rounded once."""
    base_dir = tiny_model_dir("qwen3")
    model_class = export_merged.model_class(AutoConfig.from_pretrained(base_dir))
    torch.manual_seed(1)
    peft_model = get_peft_model(
        model_class.from_pretrained(base_dir, dtype=torch.float32),
        LoraConfig(r=8, target_modules=TARGETS, init_lora_weights=False),
    )
    adapter_dir, out = tmp_path / "adapter", tmp_path / "merged-bf16"
    peft_model.save_pretrained(adapter_dir)
    fp32_merge = {k: v.clone() for k, v in peft_model.merge_and_unload().state_dict().items()}
    argv = ["--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out), "--dtype", "bfloat16"]
    assert export_merged.main(argv) == 0
    stored = load_file(out / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(stored[q_proj], fp32_merge[q_proj].to(torch.bfloat16))
    base = model_class.from_pretrained(base_dir, dtype=torch.float32).state_dict()[q_proj]
    assert not torch.equal(stored[q_proj], base.to(torch.bfloat16))  # the merge is in it
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
