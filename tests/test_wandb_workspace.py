"""scripts/wandb_workspace.py: its panels plot keys that this repo really logs (built offline, not saved)."""

from __future__ import annotations

import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf_lora_sync.patch.openrlhf_patch import rollout_parity
from openrlhf_lora_sync.sync import probe
from openrlhf_lora_sync.sync.sync import SyncStats
from openrlhf_lora_sync.tools import wandb_workspace

from rewards.math_answer import reward_func

# OpenRLHF's own keys (its experience info and status), which this repo does not produce.
OPENRLHF_KEYS = {
    "train/reward",
    "train/kl",
    "train/response_length",
    "train/policy_loss",
    "train/timing/broadcast",
}


def test_panels_plot_keys_that_are_logged():
    parity_sample = Experience(
        action_log_probs=torch.zeros(1, 2), rollout_log_probs=torch.zeros(1, 2), action_mask=torch.ones(1, 2)
    )
    reward_keys = {f"train/{k}" for k in reward_func(["q"], ["p"], ["1"])["extra_logs"]}
    floor = probe.fixed_floor([0] * 32, "bfloat16")
    reading = probe.judge(torch.zeros(31), [torch.zeros(31)], floor, "bfloat16", 0.0)
    stats = SyncStats("full", "first sync", 1, 1, 1, 0.1, probe=reading.as_metrics())
    sync_keys = {f"train/{k}" for k in stats.as_metrics()}
    sync_keys |= {f"train/{k}" for k in rollout_parity([parity_sample])}
    workspace = wandb_workspace.build_workspace("entity", "project", "GRPO LoRA")
    plotted = {key for section in workspace.sections for panel in section.panels for key in panel.y}
    unknown = plotted - reward_keys - sync_keys - OPENRLHF_KEYS
    assert not unknown, f"panels plot keys nothing logs: {sorted(unknown)}"
    assert {s.name for s in workspace.sections} == set(wandb_workspace.SECTIONS)
