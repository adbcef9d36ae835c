"""The entry points' code: each module has `main()`; scripts/NAME.py and `python -m
openrlhf_lora_sync.tools.NAME` run it (the launcher, memory_budget and preflight live with their concern,
in `patch` and `config`). result_line is the one helper among them: the JSON result line three of them
print.

Imports: any group of the package, the `testing` harness and rewards/; nothing imports them back.
"""
