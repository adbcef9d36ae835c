#!/usr/bin/env python3
"""`python scripts/export_merged.py ARGS` = `python -m openrlhf_lora_sync.tools.export_merged ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.export_merged", run_name="__main__", alter_sys=True)
