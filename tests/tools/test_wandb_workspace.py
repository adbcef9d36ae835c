"""scripts/wandb_workspace.py builds its sections offline (not saved). That its panels plot keys a real
run logs is checked on the CPU run's metrics in tests/trainer/test_cpu_run.py, so OpenRLHF renaming a
metric shows."""

from __future__ import annotations

from openrlhf_lora_sync.tools import wandb_workspace


def test_the_workspace_has_its_sections_and_every_panel_plots_something():
    workspace = wandb_workspace.build_workspace("entity", "project", "GRPO LoRA")
    assert {s.name for s in workspace.sections} == set(wandb_workspace.SECTIONS)
    assert all(panel.y for section in workspace.sections for panel in section.panels)
