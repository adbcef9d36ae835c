"""Trainer side of merge-then-sync: effective (LoRA-merged) weights under HF checkpoint names.

Covers:
- splitting a (peft-wrapped, possibly ZeRO-3-partitioned) policy into sync units, one module each:
  a LoRA layer is one unit holding its base weight/bias and its adapters; any other module with
  parameters of its own is a unit too; a `modules_to_save` wrapper contributes its trained copy;
- computing a unit's effective weights out of place, base weight upcast to fp32 plus peft's own delta
  (`get_delta_weight`: scaling, rsLoRA and fan_in_fan_out as peft defines them; computed in the
  adapters' dtype, fp32 under peft's default autocast_adapter_dtype, which OpenRLHF uses), then cast
  to the engine dtype. Nothing is merged into the model in place: bf16 merge/unmerge cycles drift;
- naming: peft runtime names (`base_model.model.…`, `.base_layer`, `modules_to_save.<adapter>`) are
  mapped back to the names the HF checkpoint on disk uses, with transformers' own reverse weight
  conversion (transformers 5 renames some families at load time, e.g. Qwen2.5-VL's
  `model.layers.*` -> `model.language_model.layers.*`), which is what vLLM's loader reads;
- refusing adapters this path does not handle (DoRA, LoRA on embeddings or convolutions, lora_bias,
  merged layers) before any sync.

Does not cover: choosing what to send (plan.py), packing and transport (bucket.py, transport.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."


class UnsupportedAdapterError(ValueError):
    """The policy's adapters cannot be synced by merge-then-sync; the message names the fix."""


@dataclass
class SyncUnit:
    """One module whose parameters are gathered, merged and sent together."""

    module_name: str  # runtime name without the peft prefix, e.g. model.language_model.layers.0.mlp.up_proj
    params: dict[str, nn.Parameter]  # local name (weight, bias) -> parameter, base weights for LoRA layers
    lora_layer: nn.Module | None = None  # the peft LoRA layer when this module carries adapters
    adapter_params: list[nn.Parameter] = field(default_factory=list)
    trained_copy: bool = False  # a peft `modules_to_save` copy, trained in full

    @property
    def has_lora(self) -> bool:
        return self.lora_layer is not None

    @property
    def changes_in_training(self) -> bool:
        return self.has_lora or self.trained_copy

    @property
    def leaf(self) -> str:
        return self.module_name.rsplit(".", 1)[-1]

    @property
    def parent(self) -> str:
        return self.module_name.rpartition(".")[0]

    def all_params(self) -> list[nn.Parameter]:
        return [*self.params.values(), *self.adapter_params]


def _strip_peft(name: str) -> str:
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def base_model_of(model: nn.Module) -> nn.Module:
    """The HF model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_supported_adapters(model: nn.Module) -> None:
    """Raise UnsupportedAdapterError for adapter kinds merge-then-sync does not handle."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        where = _strip_peft(name)
        if not isinstance(module, LoraLayer):
            raise UnsupportedAdapterError(
                f"{where}: {type(module).__name__} adapters: merge-then-sync merges LoRA only"
            )
        if any(module.use_dora.get(adapter, False) for adapter in module.active_adapters):
            raise UnsupportedAdapterError(
                f"{where}: DoRA adapters are not supported by merge-then-sync (their magnitude vector is "
                "applied after the norm of the merged weight); train with plain LoRA (use_dora=False)"
            )
        if not isinstance(module, LoraLinear):
            raise UnsupportedAdapterError(
                f"{where}: LoRA on {type(module).__name__} is not supported; target linear layers only "
                "(e.g. --ds.lora.target_modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)"
            )
        if any(module.lora_bias.get(adapter, False) for adapter in module.active_adapters):
            raise UnsupportedAdapterError(
                f"{where}: LoRA with a trainable bias (lora_bias=True) is not supported; use lora_bias=False"
            )
        if module.merged:
            raise UnsupportedAdapterError(
                f"{where}: adapters are merged into the base weight; unmerge them first"
            )


def sync_units(model: nn.Module) -> list[SyncUnit]:
    """Every module of the policy that owns parameters, in model order, as sync units."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    check_supported_adapters(model)
    units: list[SyncUnit] = []
    claimed: set[str] = set()  # module names whose subtree is already covered by a unit
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in claimed):
            continue
        if isinstance(module, LoraLayer):
            claimed.add(name)
            base = module.get_base_layer()
            adapter_params = [
                p
                for adapter in module.active_adapters
                for p in (module.lora_A[adapter].weight, module.lora_B[adapter].weight)
            ]
            units.append(
                SyncUnit(
                    _strip_peft(name),
                    dict(base.named_parameters(recurse=False)),
                    lora_layer=module,
                    adapter_params=adapter_params,
                )
            )
        elif isinstance(module, ModulesToSaveWrapper):
            claimed.add(name)
            trained = module.modules_to_save[module.active_adapters[0]]
            units.extend(
                SyncUnit(
                    ".".join(filter(None, (_strip_peft(name), sub))),
                    dict(m.named_parameters(recurse=False)),
                    trained_copy=True,
                )
                for sub, m in trained.named_modules()
                if any(True for _ in m.parameters(recurse=False))
            )
        else:
            own = dict(module.named_parameters(recurse=False))
            if own:
                units.append(SyncUnit(_strip_peft(name), own))
    return units


@contextlib.contextmanager
def _gathered(params: list[nn.Parameter]):
    """Full parameters for the duration of the block under ZeRO-3 (one module at a time), else a no-op.

    One GatheredParameters per parameter: with several in one call DeepSpeed 0.19.6 launches an async
    all-gather per parameter but waits on the last only, which on CPU/gloo (no stream ordering) lets the
    others be read mid-gather (tests/sync/test_zero3_sync.py caught it). A single parameter takes the blocking
    path; nesting contexts on different parameters is allowed."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with contextlib.ExitStack() as stack:
        for param in partitioned:
            stack.enter_context(deepspeed.zero.GatheredParameters([param], modifier_rank=None))
        yield


@torch.no_grad()
def effective_tensors(unit: SyncUnit, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The unit's weights as the merged model would hold them, as new tensors in `dtype` (runtime names).

    For a LoRA layer: W + sum over active adapters of peft's delta, computed in fp32 from gathered
    parameters, so the base weight in the model is never modified.
    """
    with _gathered(unit.all_params()):
        out = {}
        for local, param in unit.params.items():
            base = param.detach()
            # No active adapter: the base alone (adapter sync mode's base resync switches them off).
            if local == "weight" and unit.has_lora and unit.lora_layer.active_adapters:
                # The sums of base.float() + delta_1 + delta_2 ..., bit for bit, in fewer passes over memory:
                # the first delta (a new tensor: peft computes it as (B @ A) * scaling) takes the base in
                # place, and fp32 addition is commutative. Casting the sum to `dtype` makes the result new.
                value = None
                for adapter in unit.lora_layer.active_adapters:
                    delta = unit.lora_layer.get_delta_weight(adapter).float()
                    value = delta.add_(base) if value is None else value.add_(delta)
                out[f"{unit.module_name}.{local}"] = value.to(dtype)
            else:
                # A copy even when the dtype matches: under ZeRO-3 the gathered storage is freed on exit.
                out[f"{unit.module_name}.{local}"] = base.to(dtype, copy=True)
        return out


def to_checkpoint_names(base_model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runtime names -> the HF checkpoint names vLLM loads, via transformers' reverse weight conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(base_model, tensors)


def iter_effective_checkpoint_tensors(
    model: nn.Module, units: list[SyncUnit], dtype: torch.dtype
) -> Iterator[tuple[SyncUnit, dict[str, torch.Tensor]]]:
    """(unit, {checkpoint name: effective tensor}) for each unit, gathering one module at a time."""
    base = base_model_of(model)
    for unit in units:
        yield unit, to_checkpoint_names(base, effective_tensors(unit, dtype))
