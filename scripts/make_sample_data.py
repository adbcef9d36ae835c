#!/usr/bin/env python3
"""`python scripts/make_sample_data.py ARGS` = `python -m openrlhf_lora_sync.tools.make_sample_data ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.make_sample_data", run_name="__main__", alter_sys=True)
