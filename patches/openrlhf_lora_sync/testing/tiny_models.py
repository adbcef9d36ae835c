"""Tiny random Qwen models built offline, for tests, the CPU smoke run and benchmarks.

Covers: Qwen2.5-VL, Qwen3-VL, Qwen3.5 (vision-language, with linear attention) and a text-only Qwen3,
each written with `save_pretrained` into a directory together with a byte-level tokenizer, a chat
template and (for the VL families) an image/video processor, so that transformers, peft and vLLM load
them the way they load a hub checkpoint. Nothing is downloaded.

`scale="bench"` builds the same layout at a few hundred million parameters (many tensors, a real-sized
vocabulary matrix, a deeper vision tower) for scripts/bench_sync.py; the tokenizer stays byte-level, so
prompts only use the first ids of the larger vocabulary.

`logit_std` spreads the logits to a real model's magnitude (spread_logits), where bf16 noise is real-sized.
Does not cover: trained weights: logits are random, which is what equivalence checks between HF and
vLLM need. Qwen3.5 has no bench scale (its layer_types and linear-attention heads would need their own).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# 256 byte tokens, then the special tokens; the model's vocabulary is padded past both.
BYTE_VOCAB_SIZE = 256
SPECIAL_TOKEN_IDS = {token: BYTE_VOCAB_SIZE + i for i, token in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = 384

# A trimmed Qwen chat template: the same turn markers and vision placeholders as the real one, which is
# what prompt formatting, response extraction and image-token expansion depend on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in item %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_VISION_TOKEN_IDS = {
    "image_token_id": SPECIAL_TOKEN_IDS["<|image_pad|>"],
    "video_token_id": SPECIAL_TOKEN_IDS["<|video_pad|>"],
    "vision_start_token_id": SPECIAL_TOKEN_IDS["<|vision_start|>"],
    "vision_end_token_id": SPECIAL_TOKEN_IDS["<|vision_end|>"],
}
_COMMON_TEXT = {
    "vocab_size": VOCAB_SIZE,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
    "bos_token_id": SPECIAL_TOKEN_IDS["<|endoftext|>"],
    "eos_token_id": SPECIAL_TOKEN_IDS["<|im_end|>"],
    "pad_token_id": SPECIAL_TOKEN_IDS["<|endoftext|>"],
}


@dataclass(frozen=True)
class TinyFamily:
    """One model family: its HF config recipe and the dtype its vLLM-CPU kernels need."""

    name: str
    model_type: str
    architecture: str
    text_config: dict
    vision_config: dict | None
    # Qwen3.5's linear attention runs in vLLM-CPU only in bf16; everything else is compared in fp32.
    dtype: str = "float32"

    @property
    def is_vlm(self) -> bool:
        return self.vision_config is not None


FAMILIES: dict[str, TinyFamily] = {
    family.name: family
    for family in (
        TinyFamily(
            name="qwen2_5_vl",
            model_type="qwen2_5_vl",
            architecture="Qwen2_5_VLForConditionalGeneration",
            text_config={
                **_COMMON_TEXT,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
            },
            vision_config={
                "depth": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "out_hidden_size": 128,
                "fullatt_block_indexes": [1],
                "window_size": 112,
            },
        ),
        TinyFamily(
            name="qwen3_vl",
            model_type="qwen3_vl",
            architecture="Qwen3VLForConditionalGeneration",
            text_config={
                **_COMMON_TEXT,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 5e5,
                    "mrope_section": [8, 12, 12],
                    "mrope_interleaved": True,
                },
            },
            vision_config={
                "depth": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "out_hidden_size": 128,
                "num_position_embeddings": 256,
                "deepstack_visual_indexes": [1],
            },
        ),
        TinyFamily(
            name="qwen3_5",
            model_type="qwen3_5",
            architecture="Qwen3_5ForConditionalGeneration",
            text_config={
                **_COMMON_TEXT,
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                # vLLM-CPU's gated-delta-net kernel supports only 128-wide linear key/value heads.
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 1,
                "linear_num_value_heads": 2,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                },
            },
            vision_config={
                "depth": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "out_hidden_size": 128,
                "num_position_embeddings": 256,
            },
            dtype="bfloat16",
        ),
        TinyFamily(
            name="qwen3",
            model_type="qwen3",
            architecture="Qwen3ForCausalLM",
            text_config={
                **_COMMON_TEXT,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
            },
            vision_config=None,
        ),
    )
}


# Per scale: overrides of a family's text and vision config. "bench" is Qwen2.5-VL-3B's shape made narrower
# and shallower (hidden 1024, 20 layers, GQA 16:4, 32k vocabulary, 8 vision blocks): about 330M parameters.
# "bench-small" (72M) and "bench-large" (651M) bracket it for the sync's scaling (bench_trainer_sync.py).
SCALES: dict[str, tuple[dict, dict]] = {
    "tiny": ({}, {}),
    "bench-small": (
        {
            "vocab_size": 32768,
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
        },
        {"depth": 4, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "out_hidden_size": 512},
    ),
    "bench": (
        {
            "vocab_size": 32768,
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 20,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
        },
        {"depth": 8, "hidden_size": 512, "intermediate_size": 1024, "num_heads": 8, "out_hidden_size": 1024},
    ),
    "bench-large": (
        {
            "vocab_size": 32768,
            "hidden_size": 1536,
            "intermediate_size": 4096,
            "num_hidden_layers": 20,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
        },
        {"depth": 8, "hidden_size": 768, "intermediate_size": 1536, "num_heads": 12, "out_hidden_size": 1536},
    ),
}


def scaled(family: TinyFamily, scale: str) -> TinyFamily:
    """`family` at `scale` (a key of SCALES)."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: expected one of {', '.join(SCALES)}")
    text, vision = SCALES[scale]
    if scale == "tiny":
        return family
    if "layer_types" in family.text_config:
        raise ValueError(f"{family.name} has no {scale!r} scale (its layer_types are sized for the tiny one)")
    return dataclasses.replace(
        family,
        text_config={**family.text_config, **text},
        vision_config=family.vision_config and {**family.vision_config, **vision},
    )


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges plus Qwen's special tokens, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(byte_alphabet))}
    assert len(vocab) == BYTE_VOCAB_SIZE
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_config(family: TinyFamily):
    from transformers import AutoConfig

    if not family.is_vlm:
        config = AutoConfig.for_model(family.model_type, **family.text_config)
    else:
        config = AutoConfig.for_model(
            family.model_type,
            text_config={**family.text_config, "architectures": [family.architecture]},
            vision_config=family.vision_config,
            tie_word_embeddings=False,
            **_VISION_TOKEN_IDS,
        )
        # vLLM's CPU platform reads text_config.architectures (IndexError without it, seen for Qwen3-VL).
        config.text_config.architectures = [family.architecture]
    config.architectures = [family.architecture]
    config.dtype = family.dtype
    return config


def build_processor(family: TinyFamily, tokenizer):
    """The family's own processor class around the tiny tokenizer, with images kept small."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    processor_cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[family.model_type])
    patch = family.vision_config.get("patch_size", 14 if family.model_type == "qwen2_5_vl" else 16)
    merge = 2
    # Between 4 and 64 merged patches per image keeps the vision tower's sequence short on CPU.
    pixel_bounds = {"shortest_edge": (patch * merge) ** 2 * 4, "longest_edge": (patch * merge) ** 2 * 64}
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=patch, merge_size=merge, size=pixel_bounds
    )
    video_processor_name = {"qwen2_5_vl": "Qwen2VLVideoProcessor"}.get(
        family.model_type, "Qwen3VLVideoProcessor"
    )
    video_processor = getattr(transformers, video_processor_name)(patch_size=patch, merge_size=merge)
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def spread_logits(model, logit_std: float) -> None:
    """Scale the output head so the logits on random byte tokens have standard deviation `logit_std`: a
    real LLM's logits span about +-30 (std around 6), a random tiny model's std is about 0.7, and bf16's
    rounding of logits grows with their magnitude."""
    import torch

    token_ids = torch.randint(0, BYTE_VOCAB_SIZE, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        std = model(input_ids=token_ids).logits.float().std().item()
        model.get_output_embeddings().weight.mul_(logit_std / std)


def build_tiny_model(
    family_name: str, out_dir: str | Path, seed: int = 0, scale: str = "tiny", logit_std: float | None = None
) -> Path:
    """Write a random `family_name` checkpoint (config, safetensors, tokenizer, processor) to out_dir, at
    `scale` (SCALES), with its logits spread to a real model's magnitude when `logit_std` is given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    family = scaled(FAMILIES[family_name], scale)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(family)
    torch.manual_seed(seed)
    auto_cls = AutoModelForImageTextToText if family.is_vlm else AutoModelForCausalLM
    model = auto_cls.from_config(config, dtype=getattr(torch, family.dtype))
    if logit_std is not None:
        spread_logits(model, logit_std)
    model.save_pretrained(out)
    tokenizer = build_tokenizer()
    if family.is_vlm:
        build_processor(family, tokenizer).save_pretrained(out)
    else:
        tokenizer.save_pretrained(out)
    built = {"family": family.name, "seed": seed, "scale": scale, "logit_std": logit_std}
    (out / "tiny_model.json").write_text(json.dumps(built))
    return out
