#!/usr/bin/env python3
"""`python scripts/gpu_bench.py ARGS` = `python -m openrlhf_lora_sync.tools.gpu_bench ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.gpu_bench", run_name="__main__", alter_sys=True)
