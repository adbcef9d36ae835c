#!/usr/bin/env python3
"""`python scripts/prepare_data.py ARGS` = `python -m openrlhf_lora_sync.tools.prepare_data ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.prepare_data", run_name="__main__", alter_sys=True)
