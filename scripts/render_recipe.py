#!/usr/bin/env python3
"""`python scripts/render_recipe.py ARGS` = `python -m openrlhf_lora_sync.tools.render_recipe ARGS`
(documented in that module)."""

import runpy

runpy.run_module("openrlhf_lora_sync.tools.render_recipe", run_name="__main__", alter_sys=True)
