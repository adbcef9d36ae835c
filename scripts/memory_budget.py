#!/usr/bin/env python3
"""`python scripts/memory_budget.py ARGS` = `python -m openrlhf_lora_sync.config.memory_report ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.config.memory_report", run_name="__main__", alter_sys=True)
