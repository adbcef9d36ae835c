#!/usr/bin/env python3
"""Per-GPU memory budget of a GRPO + LoRA run (OpenRLHF 0.11.2, vLLM, DeepSpeed), from a model's config.json.

    python scripts/memory_budget.py --model Qwen/Qwen3.5-27B --set vllm.tensor_parallel_size=4 ...
    python scripts/memory_budget.py --table        # the reference table (README): seconds, CPU only

Hardware: none; standard library only, so preflight can run it before anything else is installed.

Covers
- Parameter counts by part (vision tower, projector/merger, language-model embeddings, decoder layers,
  lm_head) for qwen2_5_vl, qwen3_vl, qwen3_5 (incl. its Gated DeltaNet linear-attention layers) and
  text-only qwen3 / qwen3_5_text, computed from config.json fields with transformers 5.15.0's defaults
  for missing fields. tests/test_memory_budget.py checks them against `sum(p.numel())` of real models.
- LoRA parameter counts with peft's target matching ("all-linear", a list of name suffixes, or a
  regex matched against full module names), over the same module inventory.
- Peak memory per GPU in three phases, for colocated (`--train.colocate_all`) and separate vLLM GPUs:
  rollout (vLLM generating), train (actor fit) and weight sync (first sync, which is always full).

Formulas (bytes; P = all parameters, N = ZeRO world size = trainer GPUs, TP = vLLM tensor parallel,
G = GPU memory, L_P = LoRA parameters, p = parameters of one module)
- base weights: 2P (bf16). 4-bit base (`--ds.load_in_4bit`, bitsandbytes NF4 with double quantization):
  every nn.Linear weight except lm_head at 0.5 + 1/64 + 4/(64*256) bytes, everything else bf16.
- trainer at rest (rollout, sync): base/N under ZeRO-3 (all of it under ZeRO-2; 0 with the trainer base
  offload, `trainer.offload_params`: ZeRO-3 parameter offload, which also offloads the optimizer),
  LoRA bf16 weights 2*L_P/N (0 with that offload), and when DeepSpeed sleep is off (or Adam is not offloaded)
  the LoRA optimizer: Adam fp32 master + m + v = 12*L_P/N plus fp32 gradient partitions 4*L_P/N.
  OpenRLHF's `offload_deepspeed_states` moves optimizer states, gradients and fp32 params to CPU but
  not the bf16 parameters (lp_params stays commented out in 0.11.2), so the base shard stays resident.
- trainer in fit: at rest + optimizer + gradients + the ZeRO-3 working set (two decoder layers
  gathered, current and prefetched, plus the largest single module, the embedding or lm_head, gathered
  for the logits) + activations: tokens = micro_train_batch_size * max_len, and per token
  2*h*L (one bf16 checkpoint per layer) + 24*h + 16*I (one layer recomputed: its bf16 inputs, outputs
  and gradients, roughly 6h + 4I values twice) + 10*V (bf16 logits, OpenRLHF's fp32 copy and its
  gradient). Without gradient checkpointing every layer keeps 24*h + 16*I.
- reference model (`--algo.kl.init_coef` > 0): another ZeRO-3 shard 2P/N resident throughout (0 with
  `--ref.offload`, all of 2P under ZeRO-2, whose eval config is stage 0), and its own process per GPU.
  With LoRA and `sync.reference_from_base` (this repo's default) the reference is the policy with its
  adapters disabled: no second model, no process, 0 bytes.
- vLLM engine, per GPU: weights 2P/TP (vLLM keeps bf16 even under a 4-bit trainer base; replicated
  norms and biases are neglected). Awake, it holds gpu_memory_utilization * G in total: weights,
  profiled activations (8192 batched tokens * 2*(4h + 3*I/TP) + 256 sequences * V * 8 for the sampler's
  fp32 logits and probabilities), CUDA graphs (0.5 GiB unless enforce_eager) and the KV cache in the
  rest. KV per token: 2 * full-attention layers * ceil(kv_heads/TP) * head_dim * 2; Qwen3.5's linear
  layers add a fixed state per sequence: (value_heads/TP) * dk * dv * 4 (fp32 SSM state) +
  (conv_dim/TP) * (kernel - 1) * 2. Asleep (level 1 offloads weights to CPU, level 2 discards them) it
  keeps only its CUDA graphs on the GPU; with sleep off it keeps its whole budget.
- weight sync, first sync (full; every sync at sleep level 2): vLLM weights (woken, KV cache not) +
  trainer at rest + the largest gathered module: 10p for a LoRA-targeted one (bf16 gathered + fp32 base +
  fp32 delta, merged out of place) or 2p for any other one (embed_tokens, lm_head) + one bucket:
  max(bucket size, the largest fused group of LoRA-targeted tensors, the largest single tensor sent),
  twice on a shared GPU when the transport copies it (shm, nccl) instead of mapping it (CUDA IPC); a
  separate vLLM GPU holds its own received copy.
- every process on a GPU adds 0.5 GiB (CUDA context, NCCL buffers, allocator slack); a phase fits when
  its total stays 0.5 GiB under G (allocator slack).
- host RAM, for the node (Budget.host_parts): vLLM sleep level 1 keeps the weights on CPU (2P per
  engine; level 2 discards them), DeepSpeed sleep or an offloaded optimizer keeps the LoRA optimizer
  (16*L_P), the trainer base offload keeps the base (2P: every rank's pinned shard) and `--ref.offload`
  the reference (2P), and each process needs about 3 GiB of its own.

Does not cover: vision-tower activations (images through a frozen tower carry no gradients unless LoRA
targets it), ring attention, sequence packing, MoE models, the MTP head (transformers does not build it;
vLLM loads it only for speculative decoding), the `make_experience` forward passes (smaller than fit),
allocator fragmentation beyond that 0.5 GiB, and displays attached to a GPU. These are estimates
of the order of a GiB, not measurements. Host RAM leaves out the page cache of reading the checkpoint
at load time and the memlock limit for pinned memory; time is not estimated at all (the trainer base
offload copies each rank's shard, 2P/N bytes, host to GPU on every forward and backward).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GIB = 1024**3
MIB = 1024**2

# transformers 5.15.0's config-class defaults for the fields read here (tests compare them with the
# classes themselves), so that a config.json that omits a field is counted the way transformers builds it.
TEXT_DEFAULTS = {
    "qwen2_5_vl": {
        "vocab_size": 152064,
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "qwen3_vl": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "attention_bias": False,
    },
    "qwen3_5": {
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "full_attention_interval": 4,
    },
    "qwen3": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "attention_bias": False,
    },
}
VISION_DEFAULTS = {
    "qwen2_5_vl": {
        "depth": 32,
        "hidden_size": 3584,
        "intermediate_size": 3420,
        "in_channels": 3,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 3584,
    },
    "qwen3_vl": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 3584,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
}
# Qwen3.5's vision tower is Qwen3-VL's without the deepstack taps (transformers' defaults for both).
VISION_DEFAULTS["qwen3_5"] = {
    key: value for key, value in VISION_DEFAULTS["qwen3_vl"].items() if key != "deepstack_visual_indexes"
}
# model_type -> (family whose text layers it has, whether it has a vision tower)
MODEL_TYPES = {
    "qwen2_5_vl": ("qwen2_5_vl", True),
    "qwen3_vl": ("qwen3_vl", True),
    "qwen3_5": ("qwen3_5", True),
    "qwen3": ("qwen3", False),
    "qwen3_5_text": ("qwen3_5", False),
}

PARTS = ("vision", "merger", "embed", "layers", "lm_head")

# Published configs, trimmed to the fields the estimator reads. Qwen3.5-27B: the text dims are those of
# Qwen/Qwen3.5-27B's model card (hidden 5120, 64 layers in 16 x (3 Gated DeltaNet + 1 gated attention),
# FFN 17408, 24 Q / 4 KV heads of 256, linear attention 16 QK / 48 V heads of 128), and its vision config
# is the one shipped with the Qwen3.6-27B checkpoint of the same architecture. Qwen3.5-9B: its
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
class ModuleGroup:
    """`count` modules of one shape, named by `path` with `{i}` standing for their index."""

    part: str
    path: str
    count: int
    params: int  # per module, weight and bias
    linear: tuple[int, int] | None = None  # (in_features, out_features) of an nn.Linear
    layer_type: str | None = None  # decoder layers: "every", "full_attention" or "linear_attention"
    fused_group: str | None = None  # vLLM stacks these into one parameter (q/k/v, gate/up, ...)

    def names(self) -> list[str]:
        return [self.path.format(i=i) for i in range(self.count)] if "{i}" in self.path else [self.path]


@dataclass(frozen=True)
class ModelSpec:
    """What the budget needs from a model: its module inventory and a few text dimensions."""

    family: str
    modules: tuple[ModuleGroup, ...]
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    full_attention_layers: int
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
        for group in self.modules:
            counts[group.part] += group.count * group.params
        return counts

    @property
    def total_parameters(self) -> int:
        return sum(self.parameters_by_part().values())

    def largest_layer_parameters(self) -> int:
        """Parameters of the largest decoder layer (Qwen3.5's two layer types differ)."""
        per_type = {"full_attention": 0, "linear_attention": 0}
        every = 0
        for group in self.modules:
            if group.layer_type == "every":
                every += group.params
            elif group.layer_type in per_type:
                per_type[group.layer_type] += group.params
        return every + max(per_type.values())

    def largest_module_parameters(self) -> int:
        return max(group.params for group in self.modules)


def _linear(part, path, fan_in, fan_out, bias, count=1, layer_type=None, fused_group=None) -> ModuleGroup:
    return ModuleGroup(
        part,
        path,
        count,
        fan_in * fan_out + (fan_out if bias else 0),
        (fan_in, fan_out),
        layer_type,
        fused_group,
    )


def _other(part, path, params, count=1, layer_type=None) -> ModuleGroup:
    return ModuleGroup(part, path, count, params, None, layer_type)


def _text_section(config: dict) -> dict:
    # Hub configs of Qwen2.5-VL keep the text fields at the top level; newer ones nest them.
    return config.get("text_config") or config


def _tied(config: dict) -> bool:
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(_text_section(config).get("tie_word_embeddings", False))


def _text_modules(family: str, text: dict, prefix: str, tied: bool) -> tuple[list[ModuleGroup], dict]:
    t = {**TEXT_DEFAULTS[family], **{k: v for k, v in text.items() if v is not None}}
    h, inter, n_layers, vocab = (
        t["hidden_size"],
        t["intermediate_size"],
        t["num_hidden_layers"],
        t["vocab_size"],
    )
    heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = t.get("head_dim") or h // heads
    layer = f"{prefix}layers.{{i}}"
    modules = [
        _other("embed", f"{prefix}embed_tokens", vocab * h),
        _other("layers", f"{prefix}norm", h),
        _other("layers", f"{layer}.input_layernorm", h, n_layers, "every"),
        _other("layers", f"{layer}.post_attention_layernorm", h, n_layers, "every"),
        _linear("layers", f"{layer}.mlp.gate_proj", h, inter, False, n_layers, "every", "gate_up"),
        _linear("layers", f"{layer}.mlp.up_proj", h, inter, False, n_layers, "every", "gate_up"),
        _linear("layers", f"{layer}.mlp.down_proj", inter, h, False, n_layers, "every"),
    ]
    if not tied:
        modules.append(_linear("lm_head", "lm_head", h, vocab, False))
    dims = {"hidden": h, "intermediate": inter, "layers": n_layers, "vocab": vocab}
    dims.update(kv_heads=kv_heads, head_dim=head_dim, full_attention_layers=n_layers)

    if family == "qwen2_5_vl":
        # Qwen2 attention: q/k/v carry biases, o does not.
        attention = [
            ("q_proj", h, heads * head_dim, True),
            ("k_proj", h, kv_heads * head_dim, True),
            ("v_proj", h, kv_heads * head_dim, True),
        ]
        for name, fan_in, fan_out, bias in attention:
            path = f"{layer}.self_attn.{name}"
            modules.append(_linear("layers", path, fan_in, fan_out, bias, n_layers, "every", "qkv"))
        modules.append(
            _linear("layers", f"{layer}.self_attn.o_proj", heads * head_dim, h, False, n_layers, "every")
        )
        return modules, dims

    bias = bool(t.get("attention_bias"))
    if family == "qwen3_5":
        layer_types = t.get("layer_types") or [
            "full_attention" if (i + 1) % t["full_attention_interval"] == 0 else "linear_attention"
            for i in range(n_layers)
        ]
        # Legacy spellings, as transformers' remap_legacy_layer_types reads them.
        n_full = sum(kind in ("full_attention", "attention") for kind in layer_types)
        n_linear = n_layers - n_full
        query_width = 2 * heads * head_dim  # gated attention: q_proj also emits the output gate
        layer_type = "full_attention"
    else:
        n_full, n_linear = n_layers, 0
        query_width = heads * head_dim
        layer_type = "every"
    attention = [
        ("q_proj", h, query_width, "qkv"),
        ("k_proj", h, kv_heads * head_dim, "qkv"),
        ("v_proj", h, kv_heads * head_dim, "qkv"),
        ("o_proj", heads * head_dim, h, None),
    ]
    for name, fan_in, fan_out, fused in attention:
        modules.append(
            _linear("layers", f"{layer}.self_attn.{name}", fan_in, fan_out, bias, n_full, layer_type, fused)
        )
    modules.append(_other("layers", f"{layer}.self_attn.q_norm", head_dim, n_full, layer_type))
    modules.append(_other("layers", f"{layer}.self_attn.k_norm", head_dim, n_full, layer_type))
    dims["full_attention_layers"] = n_full
    if n_linear:
        # Gated DeltaNet (modeling_qwen3_5.Qwen3_5GatedDeltaNet); vLLM fuses qkv+z and b+a.
        key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
        value_heads = t["linear_num_value_heads"]
        value_dim = value_heads * t["linear_value_head_dim"]
        conv_dim = 2 * key_dim + value_dim
        kernel = t["linear_conv_kernel_dim"]
        linear_attn = f"{layer}.linear_attn"
        kind = "linear_attention"
        modules += [
            _linear(
                "layers", f"{linear_attn}.in_proj_qkv", h, conv_dim, False, n_linear, kind, "in_proj_qkvz"
            ),
            _linear(
                "layers", f"{linear_attn}.in_proj_z", h, value_dim, False, n_linear, kind, "in_proj_qkvz"
            ),
            _linear(
                "layers", f"{linear_attn}.in_proj_b", h, value_heads, False, n_linear, kind, "in_proj_ba"
            ),
            _linear(
                "layers", f"{linear_attn}.in_proj_a", h, value_heads, False, n_linear, kind, "in_proj_ba"
            ),
            _linear("layers", f"{linear_attn}.out_proj", value_dim, h, False, n_linear, kind),
            _other(
                "layers", f"{linear_attn}.conv1d", conv_dim * kernel, n_linear, kind
            ),  # depthwise, no bias
            _other("layers", f"{linear_attn}.dt_bias", value_heads, n_linear, kind),
            _other("layers", f"{linear_attn}.A_log", value_heads, n_linear, kind),
            _other("layers", f"{linear_attn}.norm", t["linear_value_head_dim"], n_linear, kind),
        ]
        dims.update(
            linear_attention_layers=n_linear,
            linear_value_heads=value_heads,
            linear_key_head_dim=t["linear_key_head_dim"],
            linear_value_head_dim=t["linear_value_head_dim"],
            linear_conv_dim=conv_dim,
            linear_conv_kernel=kernel,
        )
    return modules, dims


def _vision_modules(family: str, vision: dict) -> list[ModuleGroup]:
    v = {**VISION_DEFAULTS[family], **{k: val for k, val in vision.items() if val is not None}}
    hv, inter, depth, out = v["hidden_size"], v["intermediate_size"], v["depth"], v["out_hidden_size"]
    patch_volume = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    merged = hv * v["spatial_merge_size"] ** 2
    block = "model.visual.blocks.{i}"
    modules = [
        _linear("vision", f"{block}.attn.qkv", hv, 3 * hv, True, depth),
        _linear("vision", f"{block}.attn.proj", hv, hv, True, depth),
    ]
    if family == "qwen2_5_vl":
        # RMSNorms (weight only), a gated MLP with biases, a bias-free patch conv, an MLP merger.
        modules += [
            _other("vision", "model.visual.patch_embed.proj", patch_volume * hv),
            _other("vision", f"{block}.norm1", hv, depth),
            _other("vision", f"{block}.norm2", hv, depth),
            _linear("vision", f"{block}.mlp.gate_proj", hv, inter, True, depth, fused_group="gate_up"),
            _linear("vision", f"{block}.mlp.up_proj", hv, inter, True, depth, fused_group="gate_up"),
            _linear("vision", f"{block}.mlp.down_proj", inter, hv, True, depth),
            _other("merger", "model.visual.merger.ln_q", hv),
            _linear("merger", "model.visual.merger.mlp.0", merged, merged, True),
            _linear("merger", "model.visual.merger.mlp.2", merged, out, True),
        ]
        return modules
    # Qwen3-VL and Qwen3.5: LayerNorms, a plain MLP, a biased patch conv, learned position embeddings.
    modules += [
        _other("vision", "model.visual.patch_embed.proj", patch_volume * hv + hv),
        _other("vision", "model.visual.pos_embed", v["num_position_embeddings"] * hv),
        _other("vision", f"{block}.norm1", 2 * hv, depth),
        _other("vision", f"{block}.norm2", 2 * hv, depth),
        _linear("vision", f"{block}.mlp.linear_fc1", hv, inter, True, depth),
        _linear("vision", f"{block}.mlp.linear_fc2", inter, hv, True, depth),
        _other("merger", "model.visual.merger.norm", 2 * hv),
        _linear("merger", "model.visual.merger.linear_fc1", merged, merged, True),
        _linear("merger", "model.visual.merger.linear_fc2", merged, out, True),
    ]
    deepstack = len(v.get("deepstack_visual_indexes") or []) if family == "qwen3_vl" else 0
    if deepstack:
        # Deepstack mergers normalise after the spatial shuffle, hence the wider LayerNorm.
        merger = "model.visual.deepstack_merger_list.{i}"
        modules += [
            _other("merger", f"{merger}.norm", 2 * merged, deepstack),
            _linear("merger", f"{merger}.linear_fc1", merged, merged, True, deepstack),
            _linear("merger", f"{merger}.linear_fc2", merged, out, True, deepstack),
        ]
    return modules


def model_spec(config: dict) -> ModelSpec:
    """The module inventory of a config.json dict (a Qwen VL or text-only Qwen3 / Qwen3.5 model)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not covered; expected one of {sorted(MODEL_TYPES)}")
    family, has_vision = MODEL_TYPES[model_type]
    tied = _tied(config)
    prefix = "model.language_model." if has_vision else "model."
    modules, dims = _text_modules(family, _text_section(config), prefix, tied)
    if has_vision:
        modules += _vision_modules(family, config.get("vision_config") or {})
    return ModelSpec(family=family, modules=tuple(modules), **dims)


def load_config(model: str | Path) -> dict:
    """config.json of a local model directory, or of a reference config named by hub id."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    if str(model) in REFERENCE_CONFIGS:
        return REFERENCE_CONFIGS[str(model)]
    raise FileNotFoundError(f"{model}: no config.json there and not one of {sorted(REFERENCE_CONFIGS)}")


def lora_targets_match(name: str, targets: str | tuple[str, ...] | list[str], is_linear: bool) -> bool:
    """peft's rule: "all-linear" is every nn.Linear but the output layer; another string is a regex that
    must match the whole module name; a list matches a name equal to an entry or ending in ".entry"."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return is_linear and name != "lm_head"
        return re.fullmatch(targets, name) is not None
    return any(name == target or name.endswith("." + target) for target in targets)


def lora_modules(spec: ModelSpec, targets) -> list[tuple[ModuleGroup, int]]:
    """(group, how many of its modules LoRA wraps) for every group with at least one, Linear ones only."""
    wrapped = []
    for group in spec.modules:
        if group.linear is None:
            continue
        hits = sum(lora_targets_match(name, targets, True) for name in group.names())
        if hits:
            wrapped.append((group, hits))
    return wrapped


def lora_parameters(spec: ModelSpec, rank: int, targets) -> int:
    """A (rank x in) + B (out x rank) per wrapped nn.Linear."""
    if rank <= 0:
        return 0
    return sum(hits * rank * sum(group.linear) for group, hits in lora_modules(spec, targets))


@dataclass(frozen=True)
class Settings:
    """The knobs of a run that move GPU memory. Defaults: the user's 27B command on 4x RTX 4090, with
    OpenRLHF 0.11.2's defaults for what that command leaves out."""

    gpus: int = 4  # GPUs on the node the run uses
    gpu_mem_gib: float = 24.0
    colocate: bool = True  # --train.colocate_all
    vllm_tp: int = 4
    vllm_engines: int = 1
    vllm_sleep_level: int = 1  # 0: --vllm.enable_sleep off; OpenRLHF 0.11.2 itself always sleeps at level 1
    gpu_memory_utilization: float = 0.95
    enforce_eager: bool = False
    zero_stage: int = 3
    ds_sleep: bool = True
    adam_offload: bool = False
    param_offload: bool = False  # trainer.offload_params: ZeRO-3 parameters and optimizer in host memory
    base_4bit: bool = False  # --ds.load_in_4bit
    lora_rank: int = 64
    lora_targets: str | tuple[str, ...] = "all-linear"
    # "gpu" (--algo.kl.init_coef > 0, upstream), "cpu" (--ref.offload), "base" (the policy with its
    # adapters disabled: sync.reference_from_base with LoRA) or "none" (KL 0)
    reference: str = "gpu"
    micro_train_batch_size: int = 1
    max_len: int = 2048  # prompt + response tokens
    gradient_checkpointing: bool = False  # --actor.gradient_checkpointing_enable
    bucket_mb: int = 128  # recipes/base.yaml sync.bucket_mb
    transport: str = "cuda_ipc"  # "cuda_ipc", "shm" or "nccl"

    @property
    def vllm_gpus(self) -> int:
        return self.vllm_engines * self.vllm_tp

    @property
    def trainer_gpus(self) -> int:
        return self.gpus if self.colocate else self.gpus - self.vllm_gpus


PROCESS_OVERHEAD = int(0.5 * GIB)
CUDA_GRAPHS = int(0.5 * GIB)
HEADROOM = GIB // 2
HOST_PER_PROCESS = 3 * GIB
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
VLLM_BATCHED_TOKENS = 8192  # vLLM 0.29's LLM-class defaults on a GPU under 70 GiB
VLLM_MAX_SEQS = 256


@dataclass
class Phase:
    """One phase on its busiest GPU: named components in bytes."""

    name: str
    role: str  # "shared" (colocated), "trainer" or "vllm"
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class Budget:
    model: str
    settings: Settings
    parameters: dict[str, int]
    lora_parameters: int
    phases: list[Phase]
    kv_sequences: float  # sequences of max_len tokens the KV cache holds at once
    host_parts: dict[str, float]  # host RAM of the whole node, by what holds it
    gpu_bytes: float

    @property
    def host_bytes(self) -> float:
        return sum(self.host_parts.values())

    @property
    def usable(self) -> float:
        return self.gpu_bytes - HEADROOM

    def phase(self, name: str) -> Phase:
        return max((p for p in self.phases if p.name == name), key=lambda p: p.total)

    def fits(self, name: str | None = None) -> bool:
        """Whether one phase (every phase when name is None) fits; rollout also needs room for one
        max_len sequence in the KV cache."""
        names = [name] if name else ["rollout", "train", "sync"]
        if "rollout" in names and self.kv_sequences < 1:
            return False
        return all(self.phase(n).total <= self.usable for n in names)

    def problems(self) -> list[str]:
        """One line per phase that does not fit, with its numbers."""
        lines = []
        for name in ("rollout", "train", "sync"):
            phase = self.phase(name)
            if phase.total > self.usable:
                top = sorted(phase.parts.items(), key=lambda item: -item[1])[:4]
                detail = ", ".join(f"{part} {gib(size)}" for part, size in top)
                lines.append(
                    f"{name}: {gib(phase.total)} GiB per GPU ({phase.role}) > {gib(self.usable)} GiB usable "
                    f"of {gib(self.gpu_bytes)} ({detail})"
                )
        if self.kv_sequences < 1:
            lines.append(
                f"rollout: vLLM's budget ({self.settings.gpu_memory_utilization} x {gib(self.gpu_bytes)} GiB)"
                f" leaves no room for the KV cache of one {self.settings.max_len}-token sequence"
            )
        return lines


def gib(size: float) -> str:
    return f"{size / GIB:.1f}"


def _base_bytes(spec: ModelSpec, quantized: bool) -> float:
    if not quantized:
        return 2.0 * spec.total_parameters
    linear_weights = sum(
        g.count * g.linear[0] * g.linear[1]
        for g in spec.modules
        if g.linear is not None and g.part != "lm_head"
    )
    return 2.0 * (spec.total_parameters - linear_weights) + NF4_BYTES_PER_PARAM * linear_weights


def _activations_per_token(spec: ModelSpec, checkpointing: bool) -> float:
    one_layer = 24 * spec.hidden + 16 * spec.intermediate
    layers = 2 * spec.hidden * spec.layers + one_layer if checkpointing else one_layer * spec.layers
    return layers + 10 * spec.vocab


def _vllm_kv(spec: ModelSpec, s: Settings) -> tuple[float, float]:
    """(KV bytes per token, fixed linear-attention state bytes per sequence) on one vLLM GPU."""
    kv_per_gpu = max(1, math.ceil(spec.kv_heads / s.vllm_tp))
    per_token = 2 * spec.full_attention_layers * kv_per_gpu * spec.head_dim * 2
    state = spec.linear_attention_layers * (
        spec.linear_value_heads / s.vllm_tp * spec.linear_key_head_dim * spec.linear_value_head_dim * 4
        + spec.linear_conv_dim / s.vllm_tp * (spec.linear_conv_kernel - 1) * 2
    )
    return per_token, state


def _sync_transient(spec: ModelSpec, s: Settings, full: bool) -> tuple[float, float]:
    """(largest gathered module's working memory, bucket bytes) during a full or a delta sync."""
    wrapped = lora_modules(spec, s.lora_targets) if s.lora_rank > 0 else []
    merged = max((10.0 * group.params for group, _ in wrapped), default=0.0)
    # A full sync also gathers the modules LoRA leaves alone, the largest being embed_tokens or lm_head.
    gathered = 2.0 * spec.largest_module_parameters() if full else 0.0
    fused: dict[str, int] = {}
    for group, _ in wrapped:
        key = f"{group.part}:{group.fused_group or group.path}"
        fused[key] = fused.get(key, 0) + group.params
    bucket = max(s.bucket_mb * MIB, 2.0 * max(fused.values(), default=0), gathered)
    # On a shared GPU the engine maps a CUDA-IPC bucket in place but receives a copy of any other.
    copies = 2 if s.colocate and s.transport != "cuda_ipc" else 1
    return max(merged, gathered), copies * bucket


def estimate(spec: ModelSpec, s: Settings, model_name: str = "") -> Budget:
    """Per-GPU peak of each phase and host RAM for one setting (formulas: module docstring)."""
    if s.zero_stage not in (2, 3):
        raise ValueError("zero_stage must be 2 or 3")
    if s.param_offload and s.zero_stage != 3:
        raise ValueError("parameter offload needs ZeRO-3")
    g = s.gpu_mem_gib * GIB
    n = s.trainer_gpus
    if n <= 0:
        raise ValueError(f"{s.gpus} GPUs leave no trainer GPU beside {s.vllm_gpus} vLLM GPUs")
    p = spec.total_parameters
    lora = lora_parameters(spec, s.lora_rank, s.lora_targets)
    base = _base_bytes(spec, s.base_4bit)
    sharded = s.zero_stage == 3

    base_resident = 0.0 if s.param_offload else (base / n if sharded else base)
    # Parameter offload moves every parameter's partition, the adapters' too.
    lora_weights = 0.0 if s.param_offload else (2.0 * lora / n if sharded else 2.0 * lora)
    adam_offloaded = s.adam_offload or s.param_offload  # offload.py offloads the optimizer with the params
    optimizer = 0.0 if adam_offloaded else 12.0 * lora / n
    gradients = (2.0 if adam_offloaded else 4.0) * lora / n
    at_rest = {"base shard" if sharded else "base": base_resident, "LoRA weights": lora_weights}
    if not s.ds_sleep:
        at_rest.update({"LoRA optimizer": optimizer, "LoRA gradients": gradients})
    working_set = 0.0
    if sharded:
        layer_bytes = _base_bytes(spec, s.base_4bit) * spec.largest_layer_parameters() / p
        working_set = 2 * layer_bytes + 2.0 * spec.largest_module_parameters()
    tokens = s.micro_train_batch_size * s.max_len
    in_fit = {
        **at_rest,
        "LoRA optimizer": optimizer,
        "LoRA gradients": gradients,
        "ZeRO-3 gathered": working_set,
        "activations": tokens * _activations_per_token(spec, s.gradient_checkpointing),
    }
    trainer_processes = 1
    reference = 0.0
    if s.reference == "gpu":
        reference = 2.0 * p / n if sharded else 2.0 * p
    if s.reference in ("gpu", "cpu"):
        trainer_processes += 1

    vllm_weights = 2.0 * p / s.vllm_tp
    vllm_budget = s.gpu_memory_utilization * g
    graphs = 0.0 if s.enforce_eager else CUDA_GRAPHS
    activations = VLLM_BATCHED_TOKENS * 2 * (4 * spec.hidden + 3 * spec.intermediate / s.vllm_tp)
    activations += VLLM_MAX_SEQS * spec.vocab * 8
    kv_space = vllm_budget - vllm_weights - activations - graphs
    kv_token, state = _vllm_kv(spec, s)
    kv_sequences = kv_space / (kv_token * s.max_len + state)
    asleep = graphs if s.vllm_sleep_level > 0 else vllm_budget
    full_sync = _sync_transient(spec, s, full=True)
    delta_sync = _sync_transient(spec, s, full=False)

    def overhead(processes: int) -> dict[str, float]:
        return {"CUDA contexts": processes * PROCESS_OVERHEAD}

    trainer_side = {"reference shard": reference} if reference else {}
    if s.colocate:
        vllm_asleep = {"vLLM (asleep)": asleep}
        sync_engine = {"vLLM weights": vllm_weights, "vLLM CUDA graphs": graphs}
        if s.vllm_sleep_level == 0:
            sync_engine = {"vLLM budget": vllm_budget}
        processes = overhead(trainer_processes + 1)
        phases = [
            Phase("rollout", "shared", {"vLLM budget": vllm_budget, **at_rest, **trainer_side, **processes}),
            Phase("train", "shared", {**vllm_asleep, **in_fit, **trainer_side, **processes}),
        ]
        for name, (merge, bucket) in (("sync", full_sync), ("sync_delta", delta_sync)):
            transient = {"gathered/merged": merge, "bucket": bucket}
            phases.append(
                Phase(name, "shared", {**sync_engine, **at_rest, **trainer_side, **transient, **processes})
            )
    else:
        engine = {"vLLM budget": vllm_budget, **overhead(1)}
        processes = overhead(trainer_processes)
        phases = [
            Phase("rollout", "vllm", dict(engine)),
            Phase("train", "vllm", dict(engine)),
            Phase("rollout", "trainer", {**at_rest, **trainer_side, **processes}),
            Phase("train", "trainer", {**in_fit, **trainer_side, **processes}),
        ]
        for name, (merge, bucket) in (("sync", full_sync), ("sync_delta", delta_sync)):
            phases.append(Phase(name, "vllm", {**engine, "bucket": bucket}))
            transient = {"gathered/merged": merge, "bucket": bucket}
            phases.append(Phase(name, "trainer", {**at_rest, **trainer_side, **transient, **processes}))

    host = {"processes": HOST_PER_PROCESS * (s.vllm_gpus + n * trainer_processes)}
    if s.vllm_sleep_level == 1:
        host["vLLM weights (sleep level 1)"] = 2.0 * p * s.vllm_engines
    if s.ds_sleep or adam_offloaded:
        host["LoRA optimizer"] = 16.0 * lora
    if s.param_offload:
        host["trainer base (offload)"] = base
    if s.reference == "cpu":
        host["reference (--ref.offload)"] = 2.0 * p
    return Budget(
        model=model_name,
        settings=s,
        parameters=spec.parameters_by_part(),
        lora_parameters=lora,
        phases=phases,
        kv_sequences=kv_sequences,
        host_parts=host,
        gpu_bytes=g,
    )


# Knobs tried, in this order, to make a setting fit: cheapest in speed and fidelity first.
def _knobs(s: Settings) -> list[tuple[str, dict]]:
    knobs = []
    if s.reference in ("gpu", "cpu") and s.lora_rank > 0:
        knobs.append(("sync.reference_from_base: true (no reference model)", {"reference": "base"}))
    elif s.reference == "gpu":
        knobs.append(("--ref.offload (or --algo.kl.init_coef 0)", {"reference": "cpu"}))
    if not s.ds_sleep:
        knobs.append(("--ds.enable_sleep", {"ds_sleep": True}))
    if s.colocate and s.vllm_sleep_level == 0:
        knobs.append(("--vllm.enable_sleep", {"vllm_sleep_level": 1}))
    if not s.gradient_checkpointing:
        knobs.append(("--actor.gradient_checkpointing_enable", {"gradient_checkpointing": True}))
    if s.micro_train_batch_size > 1:
        knobs.append(("--train.micro_batch_size 1", {"micro_train_batch_size": 1}))
    if s.bucket_mb > 256:
        knobs.append(("sync bucket 256 MB", {"bucket_mb": 256}))
    if s.zero_stage == 3 and not s.param_offload:
        knobs.append(
            ("trainer.offload_params: true (ZeRO-3 parameter offload to host RAM)", {"param_offload": True})
        )
    if not s.base_4bit:
        knobs.append(("--ds.load_in_4bit", {"base_4bit": True}))
    return knobs


def host_alternatives(spec: ModelSpec, s: Settings) -> list[tuple[str, Budget]]:
    """The settings that need less host RAM than `s`, each with its estimate: vLLM sleep level 2 instead
    of 1, no trainer base offload, no CPU copy of the reference."""
    changes = []
    if s.vllm_sleep_level == 1:
        label = "sync.vllm_sleep_level: 2 (vLLM discards its weights while asleep; every sync is then full)"
        changes.append((label, {"vllm_sleep_level": 2}))
    if s.param_offload:
        changes.append(
            ("trainer.offload_params: false (the trainer's base back on the GPUs)", {"param_offload": False})
        )
    if s.reference == "cpu":
        if s.lora_rank > 0:
            changes.append(("sync.reference_from_base: true (no reference model)", {"reference": "base"}))
        else:
            changes.append(("--algo.kl.init_coef 0 (no reference model)", {"reference": "none"}))
    return [(label, estimate(spec, replace(s, **change))) for label, change in changes]


def best_utilization(spec: ModelSpec, s: Settings) -> float | None:
    """The largest gpu_memory_utilization (0.01 steps, at most 0.95) at which every phase fits, or None."""
    for hundredths in range(95, 9, -1):
        trial = replace(s, gpu_memory_utilization=hundredths / 100)
        if estimate(spec, trial).fits():
            return trial.gpu_memory_utilization
    return None


def find_fitting(spec: ModelSpec, s: Settings) -> tuple[list[str], Settings] | None:
    """The knobs to turn, with the resulting settings, for every phase to fit; None when no knob helps.

    Knobs are added in order until the setting fits (gpu_memory_utilization retuned each time), then
    each added knob that the fit does not need is dropped again."""

    def tuned(settings: Settings) -> Settings | None:
        utilization = best_utilization(spec, settings)
        return None if utilization is None else replace(settings, gpu_memory_utilization=utilization)

    applied: list[tuple[str, dict]] = []
    fitting = tuned(s)
    for knob in _knobs(s):
        if fitting is not None:
            break
        applied.append(knob)
        fitting = tuned(replace(s, **{k: v for _, change in applied for k, v in change.items()}))
    if fitting is None:
        return None
    for knob in list(applied[:-1]):
        rest = [other for other in applied if other is not knob]
        trial = tuned(replace(s, **{k: v for _, change in rest for k, v in change.items()}))
        if trial is not None:
            applied, fitting = rest, trial
    changes = [label for label, _ in applied]
    if fitting.gpu_memory_utilization != s.gpu_memory_utilization:
        changes.append(f"--vllm.gpu_memory_utilization {fitting.gpu_memory_utilization}")
    return changes, fitting


# OpenRLHF 0.11.2 train_ppo_ray defaults for the flags read below (a test reads them from its source).
OPENRLHF_DEFAULTS = {
    "actor.num_nodes": 1,
    "actor.num_gpus_per_node": 8,
    "vllm.num_engines": None,
    "vllm.tensor_parallel_size": 1,
    "vllm.gpu_memory_utilization": 0.95,
    "vllm.enable_sleep": False,
    "vllm.enforce_eager": False,
    "train.colocate_all": False,
    "ds.zero_stage": 2,
    "ds.enable_sleep": False,
    "ds.adam_offload": False,
    "ds.load_in_4bit": False,
    "ds.lora.rank": 0,
    "ds.lora.target_modules": "all-linear",
    "algo.kl.init_coef": 0.01,
    "ref.offload": False,
    "data.max_len": 2048,
    "train.micro_batch_size": 1,
    "actor.gradient_checkpointing_enable": False,
}
# This repo's own recipe keys (not OpenRLHF flags), as scripts/render_recipe.py's REPO_KEYS spells them.
REPO_KEYS = {
    "vllm_sleep_level": ("sync.vllm_sleep_level",),
    "bucket_mb": ("sync.bucket_mb",),
    "transport": ("sync.transport",),
    "param_offload": ("trainer.offload_params",),
    "reference_from_base": ("sync.reference_from_base",),
}


def settings_from_flags(flags: dict, gpu_mem_gib: float = 24.0) -> Settings:
    """Settings from a recipe flattened to dotted OpenRLHF flag names (`vllm.tensor_parallel_size`),
    OpenRLHF's defaults filling what is missing."""
    get = {**OPENRLHF_DEFAULTS, **flags}.get

    def repo(key, default):
        return next((flags[name] for name in REPO_KEYS[key] if name in flags), default)

    gpus = int(get("actor.num_nodes")) * int(get("actor.num_gpus_per_node"))
    tp = int(get("vllm.tensor_parallel_size"))
    colocate = bool(get("train.colocate_all"))
    engines = get("vllm.num_engines")
    # Without an explicit count the engines fill the actor GPUs, which colocate_all requires anyway.
    engines = int(engines) if engines else max(1, gpus // tp)
    if not colocate:
        gpus += engines * tp
    targets = get("ds.lora.target_modules")
    if isinstance(targets, list):
        targets = targets[0] if len(targets) == 1 and targets[0] == "all-linear" else tuple(targets)
    reference = "none"
    if float(get("algo.kl.init_coef")) > 0:
        reference = "cpu" if get("ref.offload") else "gpu"
        if int(get("ds.lora.rank")) > 0 and bool(repo("reference_from_base", True)):
            reference = "base"
    sleep_level = int(repo("vllm_sleep_level", 1)) if get("vllm.enable_sleep") else 0
    return Settings(
        gpus=gpus,
        gpu_mem_gib=gpu_mem_gib,
        colocate=colocate,
        vllm_tp=tp,
        vllm_engines=engines,
        vllm_sleep_level=sleep_level,
        gpu_memory_utilization=float(get("vllm.gpu_memory_utilization")),
        enforce_eager=bool(get("vllm.enforce_eager")),
        zero_stage=3 if int(get("ds.zero_stage")) == 3 else 2,
        ds_sleep=bool(get("ds.enable_sleep")),
        adam_offload=bool(get("ds.adam_offload")),
        param_offload=bool(repo("param_offload", False)),
        base_4bit=bool(get("ds.load_in_4bit")),
        lora_rank=int(get("ds.lora.rank")),
        lora_targets=targets,
        reference=reference,
        micro_train_batch_size=int(get("train.micro_batch_size")),
        max_len=int(get("data.max_len")),
        gradient_checkpointing=bool(get("actor.gradient_checkpointing_enable")),
        bucket_mb=int(repo("bucket_mb", Settings.bucket_mb)),
        transport=str(repo("transport", "cuda_ipc" if colocate else "nccl")),
    )


# The reference table: recipe-like settings on 4x RTX 4090 (one 4090 for the last two). Rows marked
# tune get the largest gpu_memory_utilization at which they fit (they keep theirs when none does).
# The user's flags (TP4, ZeRO-3 x4, LoRA r64, colocate_all, both sleeps) and OpenRLHF's defaults for the
# rest: LoRA on all-linear (vision tower included), KL reference on GPU, util 0.95, no checkpointing.
USER_27B_FLAGS = {
    "actor.model_name_or_path": "Qwen/Qwen3.5-27B",
    "actor.num_gpus_per_node": 4,
    "vllm.num_engines": 1,
    "vllm.tensor_parallel_size": 4,
    "train.colocate_all": True,
    "vllm.enable_sleep": True,
    "ds.enable_sleep": True,
    "ds.lora.rank": 64,
    "ds.zero_stage": 3,
    "algo.advantage.estimator": "group_norm",
}
# What USER_27B_FLAGS map to under upstream OpenRLHF (with sync.reference_from_base: false; through this
# repo's patch the KL reference is the base instead: tests/test_memory_budget.py checks both).
USER_27B = Settings()
LANGUAGE_ONLY_LORA = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
LEAN = replace(
    USER_27B,
    reference="none",
    lora_targets=LANGUAGE_ONLY_LORA,
    gradient_checkpointing=True,
    gpu_memory_utilization=0.5,
)
_TP2 = {"vllm_tp": 2, "vllm_engines": 2}
_ONE_GPU = {"gpus": 1, "vllm_tp": 1}
TABLE_ROWS: list[tuple[str, str, Settings, bool]] = [
    ("user's command as given (KL reference on GPU)", "Qwen/Qwen3.5-27B", USER_27B, False),
    ("27B, KL 0, language-only LoRA", "Qwen/Qwen3.5-27B", LEAN, True),
    ("27B + trainer base offload", "Qwen/Qwen3.5-27B", replace(LEAN, param_offload=True), True),
    (
        "27B + trainer base offload, sleep level 2",
        "Qwen/Qwen3.5-27B",
        replace(LEAN, param_offload=True, vllm_sleep_level=2),
        True,
    ),
    (
        "27B + base offload, sleep level 2, KL from the base",
        "Qwen/Qwen3.5-27B",
        replace(LEAN, param_offload=True, vllm_sleep_level=2, reference="base"),
        True,
    ),
    ("27B + 4-bit base", "Qwen/Qwen3.5-27B", replace(LEAN, base_4bit=True), True),
    ("9B, TP4", "Qwen/Qwen3.5-9B", LEAN, True),
    ("9B, 2 engines x TP2", "Qwen/Qwen3.5-9B", replace(LEAN, **_TP2), True),
    ("Qwen2.5-VL-7B, 2 x TP2", "Qwen/Qwen2.5-VL-7B-Instruct", replace(LEAN, **_TP2), True),
    ("Qwen3-VL-8B, 2 x TP2", "Qwen/Qwen3-VL-8B-Instruct", replace(LEAN, **_TP2), True),
    ("Qwen3.5-4B, 1 GPU", "Qwen/Qwen3.5-4B", replace(LEAN, **_ONE_GPU), True),
    ("Qwen2.5-VL-3B, 1 GPU", "Qwen/Qwen2.5-VL-3B-Instruct", replace(LEAN, **_ONE_GPU), True),
]


def table_rows(rows=None) -> list[Budget]:
    budgets = []
    for label, model, settings, tune in rows or TABLE_ROWS:
        spec = model_spec(REFERENCE_CONFIGS[model])
        utilization = best_utilization(spec, settings) if tune else None
        settings = replace(settings, gpu_memory_utilization=utilization or settings.gpu_memory_utilization)
        budgets.append(estimate(spec, settings, f"{label}, util {settings.gpu_memory_utilization}"))
    return budgets


def format_table(budgets: list[Budget]) -> str:
    lines = [
        "| setting | params (B) | LoRA (M) | rollout | train | sync (full) | sync (delta) | spare | KV seqs "
        "| host RAM | fits |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in budgets:
        total = sum(b.parameters.values()) / 1e9
        cells = [gib(b.phase(name).total) for name in ("rollout", "train", "sync", "sync_delta")]
        spare = b.usable - max(b.phase(name).total for name in ("train", "sync"))
        kv = f"{b.kv_sequences:.0f}" if b.kv_sequences >= 0 else "none"
        verdict = (
            "yes"
            if b.fits()
            else "no: " + ", ".join(n for n in ("rollout", "train", "sync") if not b.fits(n))
        )
        lines.append(
            f"| {b.model} | {total:.2f} | {b.lora_parameters / 1e6:.0f} | {' | '.join(cells)} | {gib(spare)} "
            f"| {kv} | {gib(b.host_bytes)} | {verdict} |"
        )
    lines.append("")
    lines.append(
        "GiB per GPU on its busiest GPU. The first sync is full, so 'fits' judges sync (full); sync (delta)"
        " is every later sync at vLLM sleep level 1. Rollout fills what vLLM is given (util), so 'spare' is"
        " what train and sync leave of the usable memory (G - 0.5 GiB). KV seqs: max_len-token sequences"
        " the KV cache holds at once."
    )
    return "\n".join(lines)


def describe(budget: Budget) -> str:
    """Multi-line breakdown of one budget, for preflight's report and the CLI."""
    s = budget.settings
    lines = [
        f"{budget.model}: {sum(budget.parameters.values()) / 1e9:.2f} B parameters "
        + "("
        + ", ".join(f"{part} {count / 1e9:.3f} B" for part, count in budget.parameters.items() if count)
        + f"), LoRA {budget.lora_parameters / 1e6:.1f} M",
        f"  {s.gpus} GPU(s) x {s.gpu_mem_gib} GiB, vLLM {s.vllm_engines} x TP{s.vllm_tp} "
        f"({'colocated' if s.colocate else 'separate'}), ZeRO-{s.zero_stage} over {s.trainer_gpus}, "
        f"sleep level {s.vllm_sleep_level}, util {s.gpu_memory_utilization}",
    ]
    for phase in budget.phases:
        parts = ", ".join(f"{name} {gib(size)}" for name, size in phase.parts.items() if size)
        lines.append(f"  {phase.name:7s} ({phase.role}): {gib(phase.total)} GiB = {parts}")
    kv = f"{budget.kv_sequences:.1f} sequences of {s.max_len} tokens"
    host = ", ".join(f"{name} {gib(size)}" for name, size in budget.host_parts.items())
    lines.append(f"  KV cache: {kv}")
    lines.append(f"  host RAM (node): {gib(budget.host_bytes)} GiB = {host}")
    return "\n".join(lines)


def parse_value(text: str):
    """A --set value as YAML would read it: a JSON list, true/false, a number, else the text."""
    if text.startswith("["):
        return json.loads(text)
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local model directory or a hub id in REFERENCE_CONFIGS")
    parser.add_argument("--gpu-mem-gib", type=float, default=24.0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="an OpenRLHF flag, e.g. ds.lora.rank=64",
    )
    parser.add_argument("--table", action="store_true", help="print the reference table (markdown)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = parser.parse_args(argv)
    if args.table:
        print(format_table(table_rows()))
        return 0
    if not args.model:
        parser.error("--model or --table is required")
    flags = {}
    for item in args.set:
        key, _, value = item.partition("=")
        flags[key.lstrip("-")] = parse_value(value)
    spec = model_spec(load_config(args.model))
    budget = estimate(spec, settings_from_flags(flags, args.gpu_mem_gib), args.model)
    if args.json:
        out = {
            "model": budget.model,
            "settings": asdict(budget.settings),
            "parameters": budget.parameters,
            "lora_parameters": budget.lora_parameters,
            "phases_gib": {f"{p.name}/{p.role}": round(p.total / GIB, 2) for p in budget.phases},
            "kv_sequences": budget.kv_sequences,
            "host_gib": round(budget.host_bytes / GIB, 1),
            "fits": budget.fits(),
        }
        print(json.dumps(out))
    else:
        print(describe(budget))
        for line in budget.problems():
            print("  does not fit: " + line)
    return 0 if budget.fits() else 1


if __name__ == "__main__":
    sys.exit(main())
