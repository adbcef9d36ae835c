#!/usr/bin/env python3
"""`python scripts/smoke_cpu.py ARGS` = `python -m openrlhf_lora_sync.tools.smoke_cpu ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.smoke_cpu", run_name="__main__", alter_sys=True)
