"""The entry points' code: each module has `main()`; scripts/NAME.py and `python -m
openrlhf_lora_sync.tools.NAME` run it. They use the runtime package and its `testing` harness; nothing
imports them back.
"""
