#!/usr/bin/env python3
"""`python scripts/preflight.py ARGS` = `python -m openrlhf_lora_sync.config.preflight ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.config.preflight", run_name="__main__", alter_sys=True)
