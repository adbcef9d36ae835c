"""Adapter hot-swap sync mode: the engines keep the base weights and apply the policy's LoRA adapter with
vLLM's own LoRA layers; a sync sends the adapter, not merged weights.

Covers:
- refusing, at start, what adapter mode cannot serve exactly (`check_adapter_mode_supported`): model
  families not verified here, everything merge-then-sync refuses (DoRA, LoRA on non-linear layers,
  lora_bias, merged adapters), `modules_to_save`, LoRA on the vision tower (vLLM 0.29 wraps only the
  language model unless enable_tower_connector_lora, which is experimental), per-module ranks or
  alphas, fan_in_fan_out, several active adapters, and ranks above vLLM's largest max_lora_rank;
- the engine settings (`engine_lora_kwargs`: enable_lora, max_loras=1, max_lora_rank rounded up to a
  value vLLM's LoRAConfig accepts) and the LoRARequest generation must carry (`AdapterSyncState`);
- one sync (`sync_adapter`): the adapter's lora_A/lora_B tensors under peft's names, gathered one
  parameter at a time under ZeRO-3 (merge.py's gather), cast to the engine dtype, handed to the engines
  in memory (a /dev/shm bucket, or a broadcast over merge mode's BroadcastTransport group for engines
  on other nodes; the engine builds vLLM's LoRAModel from the tensors:
  worker_extension.install_lora_adapter[_broadcast]) under a new adapter id each sync, then the
  engines' caches are reset. No disk path is involved: the LoRARequest's lora_path is a placeholder
  vLLM never reads, because the adapter is registered before any request names its id.
- the base weights: never sent, except after the engines lost them (vLLM sleep level 2 discards them,
  and waking does not restore them reliably): then the whole base is resent first through merge mode's
  full sync (sync.sync_weights) with the adapters switched off, so the engine gets W, not W + BA.

tests/sync/test_adapter_mode.py checks vLLM's logprobs with the LoRA request against the HF merge_and_unload
reference for Qwen2.5-VL, Qwen3-VL, Qwen3 (fp32) and Qwen3.5 (bf16), including LoRA on Qwen3.5's
linear-attention projections alone (reported broken in earlier vLLM releases); what has been checked
where, GPUs included: docs/fidelity.md.
Does not cover: several adapters at once, LoRA on the vision tower or on embeddings, or generation
throughput (LoRA layers slow every forward: scripts/bench_sync.py measures by how much,
docs/performance.md).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from openrlhf_lora_sync.base.upstream import vllm_lora_ranks
from openrlhf_lora_sync.sync.bucket import layout
from openrlhf_lora_sync.sync.merge import (
    PEFT_PREFIX,
    UnsupportedAdapterError,
    _gathered,
    base_model_of,
    check_supported_adapters,
    sync_units,
)
from openrlhf_lora_sync.sync.plan import SyncState
from openrlhf_lora_sync.sync.sync import DEFAULT_BUCKET_BYTES, Engines, SyncStats, sync_weights
from openrlhf_lora_sync.sync.transport import BroadcastTransport, Send, ShmSlots

# model_type -> family name; each is checked against HF's merged model by tests/sync/test_adapter_mode.py.
SUPPORTED_MODEL_TYPES = {
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_5": "Qwen3.5",
    "qwen3": "Qwen3",
}
# The vision tower's module in every supported VLM family (transformers 5 names it `model.visual`).
VISION_TOWER = "visual"
# vLLM requires a non-empty lora_path; the adapter is in the engine's memory before a request names it.
IN_MEMORY_LORA_PATH = "in-memory://openrlhf-lora-sync"


def max_lora_rank_for(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank `rank`."""
    accepted = vllm_lora_ranks()
    fitting = [value for value in accepted if value >= rank]
    if rank < 1 or not fitting:
        raise UnsupportedAdapterError(
            f"LoRA rank {rank}: vLLM's LoRA layers take ranks 1 to {accepted[-1]}; train with a rank in that "
            "range or use merge mode (LORA_SYNC_MODE=merge, recipe key sync.mode: merge)"
        )
    return fitting[0]


def engine_lora_kwargs(rank: int) -> dict:
    """vLLM engine arguments for adapter mode with adapters up to rank `rank`."""
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": max_lora_rank_for(rank)}


def lora_request_for(lora_id: int):
    """The LoRARequest that makes vLLM apply adapter `lora_id` (installed by sync_adapter)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"policy-{lora_id}", lora_int_id=lora_id, lora_path=IN_MEMORY_LORA_PATH)


def _peft_config(model: nn.Module):
    configs = getattr(model, "peft_config", None)
    if not configs:
        raise UnsupportedAdapterError("adapter mode needs a peft LoRA model (PeftModel); this model has none")
    active = getattr(model, "active_adapters", None) or list(configs)
    if len(active) != 1:
        raise UnsupportedAdapterError(
            f"adapter mode serves one adapter; {len(active)} are active ({', '.join(active)})"
        )
    return configs[active[0]]


def check_adapter_mode_supported(model: nn.Module) -> None:
    """Raise UnsupportedAdapterError, naming the fix, for anything adapter mode would not serve exactly."""
    check_supported_adapters(model)
    fix = "; or use merge mode (LORA_SYNC_MODE=merge, recipe key sync.mode: merge)"
    model_type = getattr(base_model_of(model).config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedAdapterError(
            f"adapter mode is verified against vLLM's LoRA only for "
            f"{', '.join(SUPPORTED_MODEL_TYPES.values())}; model type {model_type!r} is not among them"
            f"{fix} (or add it after tests/sync/test_adapter_mode.py shows vLLM matches the merged model)"
        )
    config = _peft_config(model)
    if config.modules_to_save:
        raise UnsupportedAdapterError(
            f"modules_to_save={config.modules_to_save}: vLLM's LoRA cannot carry fully trained modules{fix}"
        )
    if config.rank_pattern or config.alpha_pattern:
        raise UnsupportedAdapterError(
            "per-module ranks or alphas (rank_pattern/alpha_pattern): vLLM applies one r and lora_alpha "
            f"to every module{fix}"
        )
    if config.fan_in_fan_out:
        raise UnsupportedAdapterError(f"fan_in_fan_out=True (Conv1D layers): not a vLLM LoRA layout{fix}")
    vision = [
        unit.module_name
        for unit in sync_units(model)
        if unit.has_lora and VISION_TOWER in unit.module_name.split(".")
    ]
    if vision:
        raise UnsupportedAdapterError(
            f"LoRA on the vision tower ({vision[0]}, {len(vision)} modules): vLLM 0.29 applies LoRA to the "
            "language model only; target the language model's linear layers alone (recipes/base.yaml's LoRA "
            f"section shows how per family){fix}"
        )
    head = [unit.module_name for unit in sync_units(model) if unit.has_lora and unit.leaf == "lm_head"]
    if head:
        raise UnsupportedAdapterError(
            f"LoRA on the output head ({head[0]}): vLLM's LoRA layers do not wrap lm_head in these models, "
            "and the engine would refuse the adapter at the first sync; leave lm_head out of "
            f"target_modules{fix}"
        )
    max_lora_rank_for(config.r)


def vllm_peft_config(model: nn.Module) -> dict:
    """The adapter_config fields vLLM's PEFTHelper reads (scaling: lora_alpha / r, / sqrt(r) with rsLoRA)."""
    config = _peft_config(model)
    targets = config.target_modules
    return {
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "use_rslora": bool(config.use_rslora),
        "target_modules": targets if isinstance(targets, str) else sorted(targets),
        "bias": "none",
    }


def lora_tensors(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Every LoRA layer's lora_A/lora_B weights under the names peft saves them with, in `dtype`,
    gathered one parameter at a time under ZeRO-3 (every rank must call this)."""
    named = []
    for unit in sync_units(model):
        if not unit.has_lora:
            continue
        (adapter,) = unit.lora_layer.active_adapters
        for kind in ("lora_A", "lora_B"):
            weight = getattr(unit.lora_layer, kind)[adapter].weight
            with _gathered([weight]):
                value = weight.detach().to(dtype).clone()
            named.append((f"{PEFT_PREFIX}{unit.module_name}.{kind}.weight", value))
    return named


@contextlib.contextmanager
def adapters_switched_off(model: nn.Module):
    """Within the block merge.py sees no active adapter, so a sync sends the base weights W, not W + BA.
    Sets peft's per-layer active-adapter list directly: peft's own set_adapter would also flip the
    adapters' requires_grad, which the trainer owns."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    saved = [layer._active_adapter for layer in layers]
    try:
        for layer in layers:
            layer._active_adapter = []
        yield
    finally:
        for layer, active in zip(layers, saved, strict=True):
            layer._active_adapter = active


def _base_loaded_from_checkpoint() -> SyncState:
    state = SyncState()
    state.synced()
    return state


@dataclass
class AdapterSyncState:
    """Trainer-side memory of what the engines hold in adapter mode: their base weights (as merge mode's
    SyncState; in sync at start, since the engines load the checkpoint the trainer's base comes from) and
    the id of the adapter they serve (0: none yet)."""

    base: SyncState = field(default_factory=_base_loaded_from_checkpoint)
    lora_id: int = 0

    def weights_lost(self, reason: str) -> None:
        """The engines' base weights are gone (sleep level 2, restart): the next sync resends them."""
        self.base.weights_lost(reason)

    def lora_request(self):
        """The LoRARequest every generation must carry, or None before the first sync."""
        return lora_request_for(self.lora_id) if self.lora_id else None


def sync_adapter(
    model: nn.Module,
    engines: Engines,
    state: AdapterSyncState,
    *,
    dtype: torch.dtype,
    packed_modules: dict[str, list[str]] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    send: bool = True,
    transport: str | Send = "shm",
) -> SyncStats:
    """Install the policy's current adapter in the engines under a new id (and, when the engines lost
    their base weights, resend the base first). Mode "adapter", or "full" when the base was resent.
    Under ZeRO-3 every trainer rank calls this; only the rank with send=True talks to the engines.
    `transport` is the base resync's; the adapter goes through /dev/shm (vLLM keeps adapters in host
    memory and copies them into its LoRA slots itself), or over a BroadcastTransport's group when that
    is the transport (engines on other nodes share no /dev/shm)."""
    start = time.perf_counter()
    base = None
    if state.base.full_reason:
        with adapters_switched_off(model):
            base = sync_weights(
                model,
                engines,
                state.base,
                dtype=dtype,
                bucket_bytes=bucket_bytes,
                packed_modules=packed_modules,
                send=send,
                transport=transport,
            )
    named = lora_tensors(model, dtype)
    # A new id each sync rather than vLLM's in-place reload: the next request activates it, which rewrites
    # its LoRA slot in full (vLLM skips re-activating an id that is already active, whose slot a level-2
    # sleep may have discarded), and no request or cache entry can confuse it with the previous adapter.
    lora_id = state.lora_id + 1
    config = vllm_peft_config(model)

    nbytes = layout(named)[1]
    if send and isinstance(transport, BroadcastTransport):  # engines on other nodes: no shared /dev/shm
        transport.send(engines.rpc, named, "install_lora_adapter_broadcast", lora_id, config)
    elif send:
        with ShmSlots(1) as slot:
            bucket = slot.stage(named)
            metas = [tuple(meta) for meta in bucket.metas]
            engines.rpc("install_lora_adapter", bucket.path, bucket.total, metas, lora_id, config)
    if send:
        engines.reset_caches()
    state.lora_id = lora_id
    return SyncStats(
        "full" if base else "adapter",
        f"base resent ({base.reason}) + adapter" if base else "adapter only; the engines kept their base",
        len(named) + (base.tensors if base else 0),
        nbytes + (base.bytes if base else 0),
        1 + (base.buckets if base else 0),
        time.perf_counter() - start,
    )
