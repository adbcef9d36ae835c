"""scripts/wandb_workspace.py: its panels plot keys that this repo really logs (built offline, not saved)."""

from __future__ import annotations

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
    reward_keys = {f"train/{k}" for k in reward_func(["q"], ["p"], ["1"])["extra_logs"]}
    sync_keys = {
        f"train/{k}" for k in SyncStats("full", "first sync", 1, 1, 1, 0.1, 0.0, 0.0, 0.0).as_metrics()
    }
    workspace = wandb_workspace.build_workspace("entity", "project", "GRPO LoRA")
    plotted = {key for section in workspace.sections for panel in section.panels for key in panel.y}
    unknown = plotted - reward_keys - sync_keys - OPENRLHF_KEYS
    assert not unknown, f"panels plot keys nothing logs: {sorted(unknown)}"
    assert {s.name for s in workspace.sections} == set(wandb_workspace.SECTIONS)
