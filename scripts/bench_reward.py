#!/usr/bin/env python3
"""`python scripts/bench_reward.py ARGS` = `python -m openrlhf_lora_sync.tools.bench_reward ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.bench_reward", run_name="__main__", alter_sys=True)
