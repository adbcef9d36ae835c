"""Optional: a wandb workspace with the panels a GRPO + LoRA run is watched by.

Hardware: none (talks to the wandb API only). Time: seconds. Needs WANDB_API_KEY and network access.

    python scripts/wandb_workspace.py --entity ENTITY [--project qwen-vl-grpo-lora] [--name "GRPO LoRA"]
    python scripts/wandb_workspace.py --entity ENTITY --dry-run     # print the panels, save nothing

Panels: reward and accuracy (the reward's extra_logs), KL and response length (OpenRLHF's), and this
repo's weight sync: seconds, bytes, full vs delta and the post-sync probe difference. OpenRLHF logs its
training status under `train/`; the sync stats join that status (openrlhf_patch.py), hence `train/sync/*`.
Covers: creating (saving) the workspace with wandb-workspaces. Does not cover: logging (OpenRLHF does it).
"""

from __future__ import annotations

import argparse
import sys

# Section title -> (panel title, metric keys), as OpenRLHF's wandb logger names them.
SECTIONS = {
    "Reward": [
        ("reward", ["train/reward"]),
        ("accuracy and format", ["train/math_accuracy", "train/math_format"]),
        ("unparsed answers and verifier timeouts", ["train/math_no_answer", "train/math_verify_timeout"]),
    ],
    "Policy": [
        ("KL to the reference", ["train/kl"]),
        ("response length", ["train/response_length"]),
        ("policy loss", ["train/policy_loss"]),
    ],
    "Weight sync": [
        ("sync seconds", ["train/sync/seconds", "train/timing/broadcast"]),
        ("sync bytes", ["train/sync/bytes"]),
        ("full sync (1) or delta (0)", ["train/sync/full"]),
        ("post-sync probe: max |dlogprob| engine vs policy", ["train/sync/probe_max_abs_diff"]),
        ("post-sync probe: mean over its floor (warn 10, stop 25)", ["train/sync/probe_ratio"]),
        (
            "post-sync probe: mean |dlogprob| and the floor's",
            ["train/sync/probe_mean_abs_diff", "train/sync/probe_floor_mean"],
        ),
        ("rollout gen-KL engine vs trainer (gate 1e-3)", ["train/parity/gen_kl"]),
    ],
}


def build_workspace(entity: str, project: str, name: str):
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    sections = [
        ws.Section(
            name=title,
            is_open=True,
            panels=[wr.LinePlot(title=panel, x="Step", y=keys) for panel, keys in panels],
        )
        for title, panels in SECTIONS.items()
    ]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entity", required=True, help="wandb user or team")
    parser.add_argument("--project", default="qwen-vl-grpo-lora", help="the recipes' logger.wandb.project")
    parser.add_argument("--name", default="GRPO LoRA")  # wandb refuses some symbols, "+" among them
    parser.add_argument("--dry-run", action="store_true", help="print the panels; save nothing")
    args = parser.parse_args(argv)
    workspace = build_workspace(args.entity, args.project, args.name)
    for section in workspace.sections:
        print(f"{section.name}: " + "; ".join(f"{p.title} {list(p.y)}" for p in section.panels))
    if not args.dry_run:
        workspace.save()
        print(f"saved: {workspace.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
