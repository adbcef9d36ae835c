"""What a sync sends: every weight the engine holds (full) or only what LoRA changed (delta).

Covers:
- full sync: first sync, after the engine lost its weights (vLLM sleep level 2 discards them, and
  waking does not restore them reliably: see the ms-swift fix in the seeds), after an engine restart,
  or when forced;
- delta sync: the engine kept its weights (no sleep, or sleep level 1), so only modules that training
  changes (LoRA layers, `modules_to_save` copies) are sent, each expanded to its whole fused group
  (q/k/v, gate/up, Qwen3.5's in_proj_qkv/in_proj_z and in_proj_b/in_proj_a), taken from the engine
  model's own `packed_modules_mapping`, because vLLM reloads a fused layer only when all of it arrives;
- for VLMs this sends the vision tower and projector on full syncs, and on delta syncs exactly when
  LoRA targets them (they then carry LoRA layers), since nothing else in them changes in training.
Does not cover: the bytes (bucket.py) or the transfer (transport.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from openrlhf_lora_sync.sync.merge import SyncUnit

# vLLM's packed_modules_mapping for the supported families, used when the engine cannot be asked.
DEFAULT_PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
}


@dataclass
class SyncPlan:
    mode: str  # "full" or "delta"
    reason: str
    units: list[SyncUnit]

    @property
    def module_names(self) -> list[str]:
        return [unit.module_name for unit in self.units]


class SyncState:
    """Trainer-side memory of whether the engines still hold the last synced policy."""

    def __init__(self) -> None:
        self.full_reason: str | None = "first sync"

    def weights_lost(self, reason: str) -> None:
        """The engine's weights are gone or unknown (sleep level 2, restart, fault): next sync is full."""
        self.full_reason = reason

    def next_plan(
        self, units: list[SyncUnit], packed_modules: dict[str, list[str]], force_full: bool = False
    ):
        reason = "forced" if force_full else self.full_reason
        plan = full_plan(units, reason) if reason else delta_plan(units, packed_modules)
        return plan

    def synced(self) -> None:
        self.full_reason = None


def full_plan(units: list[SyncUnit], reason: str) -> SyncPlan:
    return SyncPlan("full", reason, list(units))


def delta_plan(units: list[SyncUnit], packed_modules: dict[str, list[str]]) -> SyncPlan:
    groups = [set(members) for members in packed_modules.values()]
    wanted: set[str] = set()
    for unit in units:
        if not unit.changes_in_training:
            continue
        wanted.add(unit.module_name)
        for group in groups:
            if unit.leaf in group:
                wanted.update(f"{unit.parent}.{member}" for member in group)
    return SyncPlan("delta", "engine kept its weights", [u for u in units if u.module_name in wanted])
