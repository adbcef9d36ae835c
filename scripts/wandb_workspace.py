#!/usr/bin/env python3
"""`python scripts/wandb_workspace.py ARGS` = `python -m openrlhf_lora_sync.tools.wandb_workspace ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.wandb_workspace", run_name="__main__", alter_sys=True)
