"""Checkpoints and adapters built the way users' arrive, not by tiny_models.py.

Covers: Qwen2.5-VL, Qwen3-VL and Qwen3.5 configs made by transformers' own config classes from only the
fields a published config.json has (tiny sizes, max_position_embeddings 256, below the harness's 1024;
Qwen2.5-VL flat with mrope rope_scaling, Qwen3-VL's text_config without `architectures` as Qwen3VLConfig
saves it), a character-level tokenizer with Qwen's special tokens at the configs' ids and a chat template,
models written by `save_pretrained` with no processor files, and adapters as peft's `save_pretrained`
writes them (random non-zero LoRA unless told otherwise). Shared by the tests of users' inputs, their
faults, unreadable weights and the CPU run on a checkpoint built elsewhere.
Does not cover: processors (each test builds the one it needs from transformers' classes).
torch, transformers and peft are imported inside the builders.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_IDS = {
    "<|image_pad|>": 500,
    "<|video_pad|>": 501,
    "<|vision_start|>": 502,
    "<|vision_end|>": 503,
    "<|im_start|>": 504,
    "<|endoftext|>": 505,
    "<|im_end|>": 506,
}
VISION_IDS = {
    "image_token_id": 500,
    "video_token_id": 501,
    "vision_start_token_id": 502,
    "vision_end_token_id": 503,
}
TEXT = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "bos_token_id": 505,
    "eos_token_id": 506,
}
QWEN_VL_VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def qwen2_5_vl_config(hidden_size=64, mrope_section=(4, 6, 6)):
    from transformers import Qwen2_5_VLConfig

    # Qwen2.5-VL's published config.json is flat: text fields at the top level, rope_scaling of type mrope.
    return Qwen2_5_VLConfig(
        **{**TEXT, "hidden_size": hidden_size},
        rope_scaling={"type": "mrope", "mrope_section": list(mrope_section)},
        vision_config={**QWEN_VL_VISION, "out_hidden_size": hidden_size, "fullatt_block_indexes": [1]},
        **VISION_IDS,
    )


def qwen3_vl_config():
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True}
    return Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 32, "rope_scaling": rope},
        vision_config={**QWEN_VL_VISION, "out_hidden_size": 64, "deepstack_visual_indexes": [1]},
        **VISION_IDS,
    )


def qwen3_5_config():
    from transformers import Qwen3_5Config

    rope = {
        "rope_type": "default",
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    text = {
        **TEXT,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "head_dim": 64,
        # vLLM-CPU's gated-delta-net kernel runs only 128-wide linear key/value heads.
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "rope_parameters": rope,
    }
    return Qwen3_5Config(
        text_config=text, vision_config={**QWEN_VL_VISION, "out_hidden_size": 64}, **VISION_IDS
    )


def qwen_tokenizer():
    """A character-level tokenizer with Qwen's special tokens at the config's ids, as a hub tokenizer has."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): i for i, c in enumerate([10, *range(32, 127)])} | SPECIAL_IDS
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(list(SPECIAL_IDS))
    built = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    built.chat_template = CHAT_TEMPLATE
    return built


def save_model(config, out: Path, vlm: bool) -> Path:
    """A model of `config` with seeded random weights, written by save_pretrained to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(0)
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(config)
    model.save_pretrained(out)
    return out


def save_adapter(model_dir: Path, out: Path, vlm: bool, **lora) -> Path:
    """A peft adapter on q_proj/v_proj (r 4, random non-zero B; `lora` overrides LoraConfig's fields) of
    the model in `model_dir`, written by peft's save_pretrained to `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    base = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(model_dir)
    torch.manual_seed(1)
    lora = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "init_lora_weights": False,
    } | lora
    get_peft_model(base, LoraConfig(**lora)).save_pretrained(out)
    return out
