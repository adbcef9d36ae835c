#!/usr/bin/env python3
"""GPU figures the memory/time estimates assume: pinned host<->GPU copy bandwidth and the LoRA merge of one
Qwen3.5-27B-shaped decoder layer, as one JSON line.

Hardware: one CUDA GPU (any; the numbers are for the GPU it runs on). Without CUDA it runs the same code
at tiny sizes on the CPU in a few seconds, so tests/gpu/test_gpu_bench.py can smoke it; its numbers then say
"not run" for the GPU figures. Needs torch, transformers and peft only (and this package's merge.py and
model_inventory.py's REFERENCE_CONFIGS): no vLLM, Ray, DeepSpeed or OpenRLHF (tests/gpu/test_gpu_bench.py runs
it with those hidden), and the package need not be installed. On a bare GPU host, from a copy of this
repository's root:

    PYTHONPATH=patches python -m openrlhf_lora_sync.tools.gpu_bench [--repeats 5]

(`python scripts/gpu_bench.py` runs the same where the package is installed.) Expected time: under a
minute on a recent GPU (about 2 GB of GPU memory), a few seconds on CPU.

What it measures
- Copies between pinned host memory and the GPU, both directions, at 64 MiB, 256 MiB and 1 GiB (medians
  of --repeats, GB/s = 1e9 bytes/s): what ZeRO-3 parameter offload streams on every forward and backward,
  and what vLLM sleep level 1 moves at every sleep and wake.
- The merge of one decoder layer of each kind Qwen3.5-27B has (Gated DeltaNet linear attention and full
  attention), dimensions from model_inventory.py's REFERENCE_CONFIGS, built by transformers'
  Qwen3_5DecoderLayer in bf16 with peft LoRA r=64 (alpha 128, fp32 adapters: peft's default autocast,
  as OpenRLHF trains) on every projection the 27B recipe targets, random B. Timed: merge.py's
  sync_units + effective_tensors (base in fp32 + peft's get_delta_weight, cast to bf16), what every
  sync does per module, without ZeRO-3's gather. `merge_model_estimate_s` scales the two layer times by
  the model's layer pattern (48 linear, 16 full attention). `merge_vs_peft` checks the merged full-attention
  layer against peft's merge_and_unload (bf16 rounding), `delta_vs_base` that the merge changed it.
Does not cover: ZeRO-3 gathers across GPUs, NCCL, vLLM's reload, or the vision tower.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

MODEL = "Qwen/Qwen3.5-27B"
LORA_RANK = 64
LORA_ALPHA = 128
# The 27B recipe's targets that a Qwen3.5 decoder layer has.
LORA_TARGETS = [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
]  # fmt: skip
GPU_COPY_BYTES = (64 << 20, 256 << 20, 1 << 30)
CPU_COPY_BYTES = (1 << 20, 4 << 20)
# CPU smoke: the 27B layout at toy widths (same head structure and layer pattern).
CPU_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


def _timed(fn, repeats: int, sync) -> float:
    fn()  # warm-up: allocator, kernels
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, sizes, repeats: int, sync) -> dict:
    """GB/s host->device and device->host per size (pinned host memory on CUDA)."""
    pinned = device.type == "cuda"
    out = {"h2d_gbps": {}, "d2h_gbps": {}}
    for size in sizes:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        h2d = _timed(lambda host=host, dev=dev: dev.copy_(host, non_blocking=True), repeats, sync)
        d2h = _timed(lambda host=host, dev=dev: host.copy_(dev, non_blocking=True), repeats, sync)
        out["h2d_gbps"][f"{size >> 20}MiB"] = round(size / h2d / 1e9, 2)
        out["d2h_gbps"][f"{size >> 20}MiB"] = round(size / d2h / 1e9, 2)
        del host, dev
    return out


def text_config(tiny: bool):
    from transformers import Qwen3_5TextConfig

    from openrlhf_lora_sync.config.model_inventory import REFERENCE_CONFIGS

    fields = dict(REFERENCE_CONFIGS[MODEL]["text_config"])
    if tiny:
        fields.update(CPU_TEXT_CONFIG)
    return Qwen3_5TextConfig(**fields)


def lora_layer(config, kind: str, device: torch.device):
    """A peft-wrapped bf16 Qwen3_5DecoderLayer of `kind`, fp32 adapters with random B."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    torch.manual_seed(0)
    layer_idx = config.layer_types.index(kind)
    with torch.device(device):
        layer = Qwen3_5DecoderLayer(config, layer_idx).to(torch.bfloat16)
    lora = LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS, init_lora_weights=False
    )
    return get_peft_model(layer, lora)


def merge_layer(model) -> dict[str, torch.Tensor]:
    from openrlhf_lora_sync.sync.merge import effective_tensors, sync_units

    merged = {}
    for unit in sync_units(model):
        merged.update(effective_tensors(unit, torch.bfloat16))
    return merged


def merge_check(model, merged: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max |merge.py - peft merge_and_unload|, max |merge.py - base|) over the LoRA layers' weights."""
    reference = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    base = {
        name.replace(".base_layer", "").removeprefix("base_model.model."): p
        for name, p in model.named_parameters()
        if "lora_" not in name
    }
    targeted = [
        name for name in merged if name.rsplit(".", 2)[-2] in LORA_TARGETS and name.endswith(".weight")
    ]
    vs_peft = max((merged[n].float() - reference[n].float()).abs().max().item() for n in targeted)
    vs_base = max((merged[n].float() - base[n].float()).abs().max().item() for n in targeted)
    return vs_peft, vs_base


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    result = {
        "device": torch.cuda.get_device_name() if gpu else "cpu (no GPU: tiny sizes; GPU figures not run)",
        "gpu_figures": "measured" if gpu else "not run",
        "torch": torch.__version__,
        **copy_bandwidth(device, GPU_COPY_BYTES if gpu else CPU_COPY_BYTES, args.repeats, sync),
    }
    config = text_config(tiny=not gpu)
    result["layer_dims"] = {
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "lora_rank": LORA_RANK,
    }
    seconds = {}
    for kind in ("linear_attention", "full_attention"):
        model = lora_layer(config, kind, device)
        with torch.no_grad():
            seconds[kind] = _timed(lambda model=model: merge_layer(model), args.repeats, sync)
            if kind == "full_attention":
                vs_peft, vs_base = merge_check(model, merge_layer(model))
        result[f"{kind}_layer_params"] = sum(p.numel() for p in model.parameters())
        del model
    result["merge_s"] = {kind: round(s, 5) for kind, s in seconds.items()}
    # The model's layer pattern (config.layer_types: 48 linear, 16 full attention), also at tiny widths.
    result["merge_model_estimate_s"] = round(
        sum(config.layer_types.count(k) * s for k, s in seconds.items()), 3
    )
    result["merge_vs_peft"] = vs_peft
    result["delta_vs_base"] = vs_base
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
