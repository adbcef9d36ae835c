#!/usr/bin/env bash
# Runs ruff and the test suite (CPU; `gpu` tests skip without CUDA). Builds .venv/ first when it is
# missing or stale (versions.toml or the setup scripts changed), via scripts/setup_env.sh.
#
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .

set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
# pytest exits 5 when the selection matched no test (e.g. `-m gpu` on a CPU machine): not a failure.
if [[ $status -eq 5 ]]; then
  echo "test.sh: no tests were collected for this selection"
  exit 0
fi
exit $status
