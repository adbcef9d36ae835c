"""The module inventory of a model, built from its config.json on the meta device: what the memory budget
(memory_budget.py) counts, with no weights and no memory.

    spec = model_spec(load_config("Qwen/Qwen3.5-27B"))       # a local directory, or a hub id below
    spec.total_parameters, spec.parameters_by_part(), lora_parameters(spec, 64, "all-linear")

Hardware: none. Runs in the repo's .venv: torch, transformers and peft are imported when a model is
first built (a weightless copy on the meta device, cached per config; its time: docs/memory.md).

Covers
- The module inventory of the model OpenRLHF's Actor loads, built from its config on the meta device by
  config_checks.meta_model (no weights, no memory): every module holding parameters, counted once (tied
  embeddings under embed_tokens), by part (vision tower, projector/merger, language-model embeddings,
  decoder layers, lm_head), its nn.Linear shape, its decoder layer and that layer's type
  (text_config.layer_types: Qwen3.5's Gated DeltaNet and gated-attention layers), and the stacked tensor
  vLLM loads it into (VLLM_STACKED: q/k/v, gate/up, Qwen3.5's in_proj_qkv/z and in_proj_b/a). Dimensions
  (hidden size, KV heads, head_dim, linear-attention heads) are read from the transformers config object,
  so a config.json that omits a field gets transformers' own default.
- LoRA parameter counts: peft's get_peft_model with the LoraConfig OpenRLHF builds
  (config_checks.openrlhf_lora_config) on a fresh meta model; the lora_ parameters peft creates are
  counted and the modules it wraps are the ones the sync merges.
- REFERENCE_CONFIGS: the published configs of the models the recipes and the memory table name, trimmed
  to their size fields, for hub ids without a local copy (load_config).
Does not cover: what the modules cost in GPU memory (memory_budget.py).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from openrlhf_lora_sync.config import config_checks

PARTS = ("vision", "merger", "embed", "layers", "lm_head")
# vLLM 0.29's packed_modules_mapping of its Qwen2.5-VL, Qwen3-VL and Qwen3.5 classes, read the other way:
# the stacked tensor each checkpoint module's weight is loaded into (a test compares them with vLLM's).
VLLM_STACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "in_proj_qkv": "in_proj_qkvz",
    "in_proj_z": "in_proj_qkvz",
    "in_proj_b": "in_proj_ba",
    "in_proj_a": "in_proj_ba",
}
DECODER_LAYER = re.compile(r"\blayers\.(\d+)\.")


# Published configs, for hub ids without a local copy (load_config), trimmed to their size fields:
# transformers' defaults fill the rest. Qwen3.5-27B: the text dims are those of Qwen/Qwen3.5-27B's model
# card (hidden 5120, 64 layers in 16 x (3 Gated DeltaNet + 1 gated attention), FFN 17408, 24 Q / 4 KV
# heads of 256, linear attention 16 QK / 48 V heads of 128), and its vision config is the one shipped
# with the Qwen3.6-27B checkpoint of the same architecture. Qwen3.5-9B: its
# config.json text fields; its vision tower is assumed to be the 27B's with out_hidden_size = 4096.
# Qwen3.5-4B: text fields from its config.json; untied embeddings and the 27B's vision tower
# (out_hidden_size = 2560) are assumed.
_QWEN3_5_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_position_embeddings": 2304,
}
REFERENCE_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen3.5-27B": {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 248320,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "full_attention_interval": 4,
        },
        "vision_config": {**_QWEN3_5_VISION, "out_hidden_size": 5120},
    },
    "Qwen/Qwen3.5-9B": {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 248320,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
        },
        "vision_config": {**_QWEN3_5_VISION, "out_hidden_size": 4096},
    },
    "Qwen/Qwen3.5-4B": {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 248320,
            "hidden_size": 2560,
            "intermediate_size": 9216,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
        },
        "vision_config": {**_QWEN3_5_VISION, "out_hidden_size": 2560},
    },
    "Qwen/Qwen2.5-VL-7B-Instruct": {
        "model_type": "qwen2_5_vl",
        "tie_word_embeddings": False,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "out_hidden_size": 3584,
        },
    },
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "model_type": "qwen2_5_vl",
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "out_hidden_size": 2048,
        },
    },
    "Qwen/Qwen3-VL-8B-Instruct": {
        "model_type": "qwen3_vl",
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
        },
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "out_hidden_size": 4096,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    },
}


@dataclass(frozen=True)
class Module:
    """One module of the model that holds parameters of its own (a tied weight counts where it first
    appears, under embed_tokens)."""

    name: str  # as named_modules() names it: model.language_model.layers.3.mlp.gate_proj
    part: str  # one of PARTS
    params: int  # its own parameters (weight and bias; not its submodules')
    linear: tuple[int, int] | None = None  # (in_features, out_features) of an nn.Linear
    layer: int | None = None  # the decoder layer it belongs to
    layer_type: str | None = None  # that layer's text_config.layer_types entry
    stacked: str | None = None  # the vLLM tensor it is loaded into with its siblings (VLLM_STACKED)


@dataclass(frozen=True)
class ModelSpec:
    """What the budget needs from a model: its module inventory and a few text dimensions."""

    config_json: str  # the config.json it was built from, canonical JSON (keys the LoRA cache)
    model_type: str
    modules: tuple[Module, ...]
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    full_attention_layers: int  # layers with a KV cache
    kv_heads: int
    head_dim: int
    linear_attention_layers: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_dim: int = 0
    linear_conv_kernel: int = 0

    def parameters_by_part(self) -> dict[str, int]:
        counts = dict.fromkeys(PARTS, 0)
        for module in self.modules:
            counts[module.part] += module.params
        return counts

    @property
    def total_parameters(self) -> int:
        return sum(module.params for module in self.modules)

    def largest_layer_parameters(self) -> int:
        """Parameters of the largest decoder layer (Qwen3.5's two layer types differ)."""
        per_layer: dict[int, int] = {}
        for module in self.modules:
            if module.layer is not None:
                per_layer[module.layer] = per_layer.get(module.layer, 0) + module.params
        return max(per_layer.values(), default=0)

    def largest_module_parameters(self) -> int:
        return max(module.params for module in self.modules)


def _part(name: str, module, model) -> str:
    if module is model.get_output_embeddings():
        return "lm_head"
    if module is model.get_input_embeddings():
        return "embed"
    if name.startswith("model.visual."):
        return "merger" if "merger" in name else "vision"
    return "layers"


def _canonical(config: Mapping) -> str:
    return json.dumps(config, sort_keys=True)


@functools.cache
def _spec_from_json(config_json: str) -> ModelSpec:
    from torch import nn

    model = config_checks.meta_model(json.loads(config_json))
    text = model.config.get_text_config()
    layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    owners: dict[str, int] = {}
    for name, parameter in model.named_parameters():  # each shared (tied) parameter once, first owner
        owner = name.rpartition(".")[0]
        owners[owner] = owners.get(owner, 0) + parameter.numel()
    modules = []
    for name, params in owners.items():
        module = model.get_submodule(name)
        found = None if name.startswith("model.visual.") else DECODER_LAYER.search(name)
        layer = int(found.group(1)) if found else None
        is_linear = isinstance(module, nn.Linear)
        modules.append(
            Module(
                name=name,
                part=_part(name, module, model),
                params=params,
                linear=(module.in_features, module.out_features) if is_linear else None,
                layer=layer,
                layer_type=layer_types[layer] if layer is not None else None,
                stacked=VLLM_STACKED.get(name.rpartition(".")[2]) if is_linear else None,
            )
        )
    heads = text.num_attention_heads
    dims = {
        "hidden": text.hidden_size,
        "intermediate": text.intermediate_size,
        "layers": text.num_hidden_layers,
        "vocab": text.vocab_size,
        "full_attention_layers": sum(kind != "linear_attention" for kind in layer_types),
        "kv_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
    }
    linear_layers = layer_types.count("linear_attention")
    if linear_layers:
        key_dim = text.linear_num_key_heads * text.linear_key_head_dim
        dims.update(
            linear_attention_layers=linear_layers,
            linear_value_heads=text.linear_num_value_heads,
            linear_key_head_dim=text.linear_key_head_dim,
            linear_value_head_dim=text.linear_value_head_dim,
            linear_conv_dim=2 * key_dim + text.linear_num_value_heads * text.linear_value_head_dim,
            linear_conv_kernel=text.linear_conv_kernel_dim,
        )
    return ModelSpec(config_json, model.config.model_type, tuple(modules), **dims)


def model_spec(config: Mapping) -> ModelSpec:
    """The module inventory of the model a config.json dict (model_type included) builds: the one
    OpenRLHF's Actor loads, on the meta device. Cached per config."""
    return _spec_from_json(_canonical(config))


def load_config(model: str | Path) -> dict:
    """config.json of a local model directory, or of a reference config named by hub id."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    if str(model) in REFERENCE_CONFIGS:
        return REFERENCE_CONFIGS[str(model)]
    raise FileNotFoundError(f"{model}: no config.json there and not one of {sorted(REFERENCE_CONFIGS)}")


@dataclass(frozen=True)
class LoraInventory:
    """What peft's get_peft_model makes of a model for one rank and target_modules."""

    modules: frozenset[str]  # the modules it wraps, named as in ModelSpec.modules
    parameters: int  # the lora_ parameters it creates


@functools.cache
def _peft_inventory(config_json: str, rank: int, targets: str | tuple[str, ...]) -> LoraInventory:
    import torch
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    base = config_checks.meta_model(json.loads(config_json))
    lora_config = config_checks.openrlhf_lora_config(
        rank, None, targets if isinstance(targets, str) else list(targets), None
    )
    with torch.device("meta"):  # the adapters too: nothing allocated, nothing initialised
        peft_model = get_peft_model(base, lora_config)
    prefix = peft_model.base_model.prefix  # "lora_"
    wrapped = frozenset(
        name.removeprefix("base_model.model.")
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer)
    )
    parameters = sum(p.numel() for name, p in peft_model.named_parameters() if f".{prefix}" in name)
    return LoraInventory(wrapped, parameters)


def lora_inventory(spec: ModelSpec, rank: int, targets: str | tuple[str, ...]) -> LoraInventory:
    """peft's LoRA on this model (OpenRLHF's LoraConfig; targets: "all-linear", a regex, or a tuple of
    module-name suffixes); nothing for rank 0. Raises ValueError when peft does (no module matches)."""
    if rank <= 0:
        return LoraInventory(frozenset(), 0)
    try:
        return _peft_inventory(spec.config_json, rank, targets)
    except ValueError as error:
        message = str(error).splitlines()[0]
        raise ValueError(
            f"ds.lora.target_modules {targets!r} on {spec.model_type}: peft: {message}"
        ) from None


def lora_modules(spec: ModelSpec, rank: int, targets) -> list[Module]:
    """The modules of the inventory that peft wraps in LoRA layers."""
    wrapped = lora_inventory(spec, rank, targets).modules
    return [module for module in spec.modules if module.name in wrapped]


def lora_parameters(spec: ModelSpec, rank: int, targets) -> int:
    return lora_inventory(spec, rank, targets).parameters
