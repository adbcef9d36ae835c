#!/usr/bin/env python3
"""`python scripts/bench_offload.py ARGS` = `python -m openrlhf_lora_sync.tools.bench_offload ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.bench_offload", run_name="__main__", alter_sys=True)
