#!/usr/bin/env bash
# Runs the tests that touch upstream (OpenRLHF, vLLM, peft, DeepSpeed) on another stack of versions.toml
# than the default one: builds its environment with scripts/setup_env.sh first (idempotent).
#
#   bash scripts/test_upstream.sh --cpu-oldest        # the oldest supported releases, in .venv-oldest/
#   bash scripts/test_upstream.sh --cpu-newest        # the newest supported vLLM: contract, engine vs HF
#   bash scripts/test_upstream.sh --cpu-oldest -x     # extra arguments go to pytest
#
# The full suite runs on the default stack (scripts/test.sh); this is the subset whose outcome depends on
# the upstream release: the contract and the version shims, the engine against HF, OpenRLHF's own suite
# under the patch, the sync in merge and adapter mode (every family, fp32 and bf16), verify_sync.py, the
# faults, the launcher's config checks, the patched method in OpenRLHF's engine actor, and OpenRLHF's real
# trainer learning above its control.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

UPSTREAM_TESTS=(
  tests/upstream/test_openrlhf_contract.py
  tests/upstream/test_upstream_versions.py
  tests/unit/test_supported_versions.py
  tests/sync/test_engine_equivalence.py
  tests/upstream/test_openrlhf_own_suite.py
  tests/sync/test_sync.py
  tests/sync/test_adapter_mode.py
  tests/sync/test_verify_sync.py
  tests/sync/test_faults.py
  tests/sync/test_probe_real_logits.py
  tests/inputs/test_config_checks.py
  tests/sync/test_openrlhf_patch.py
  # Of the real trainer's runs, the learning run against its control and the metric keys it logs; the
  # run on a checkpoint built elsewhere and the one under an empty CUDA_VISIBLE_DEVICES test the host and
  # the inputs, which no release changes (the default stack runs them).
  tests/trainer/test_cpu_run.py::test_the_main_job_is_openrlhfs_trainer_and_learns_above_its_control
  tests/trainer/test_cpu_run.py::test_the_wandb_workspace_plots_keys_the_real_run_logs
)
case "${1:-}" in
  --cpu-oldest) venv=.venv-oldest; tests=("${UPSTREAM_TESTS[@]}") ;;
  # the newest vLLM: its contract, the shims and the engine against HF (the first four)
  --cpu-newest) venv=.venv-newest; tests=("${UPSTREAM_TESTS[@]:0:4}") ;;
  *) echo "usage: bash scripts/test_upstream.sh --cpu-oldest|--cpu-newest [pytest arguments]" >&2; exit 2 ;;
esac
stack_flag="$1"
shift

bash scripts/setup_env.sh "$stack_flag"
# The run script (tests/trainer/test_cpu_run.py starts it) takes this stack's Python too.
export LORA_SYNC_PYTHON="$ROOT/$venv/bin/python"
"$venv/bin/python" -m pytest "${tests[@]}" "$@"
