#!/usr/bin/env python3
"""`python scripts/bench_trainer_sync.py ARGS` = `python -m openrlhf_lora_sync.tools.bench_trainer_sync ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.bench_trainer_sync", run_name="__main__", alter_sys=True)
