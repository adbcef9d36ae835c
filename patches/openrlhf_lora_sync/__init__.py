"""LoRA-aware policy-to-vLLM weight sync for OpenRLHF, vendored as a run-time patch, and the tools around it.

Installed under its own name by scripts/setup_env.sh (editable), so that every process of a run, Ray
actors and vLLM engine processes included, can import it. One sub-package per concern, each __init__
saying what it holds; each module's docstring says what it covers:

    base/      settings, pins, upstream: the facts every part reads (standard library only)
    sync/      the LoRA-aware weight sync: merge, plan, bucket, transport, the sync loop, worker extension
    config/    recipes -> checked runs, the checks before a run, the memory budget, preflight
    patch/     the run-time patch of OpenRLHF and its launcher
    testing/   the harness shared by tests/ and the tools
    tools/     the entry points' main()

Imports go one way: a group imports only itself and the groups listed before it, never one after it
(tools -> testing -> patch -> config -> sync -> base); rewards/ imports only `base`, and only `tools` imports
rewards/ (tests/unit/test_layout.py checks both). Importing this package imports nothing but the
standard library; it silences, at their source, third-party messages that need no action here (below),
since every entry point and Ray worker of the patch imports it first.
"""

import builtins
import logging
import re
import warnings
from pathlib import Path

# The checkout this package sits in (recipes/, data/, rewards/): meaningful for the editable install that
# setup_env.sh makes; a non-editable install resolves recipes relative to the working directory instead.
REPO_ROOT = Path(__file__).resolve().parents[2]

# Third-party warnings that ask nothing of this repo's users, as (message prefix, category, module) the way
# PYTHONWARNINGS spells them. Silenced below in every process that imports this package, and, through
# PYTHONWARNINGS (python_warnings(), which the launcher puts in every Ray worker's environment), in the
# processes that import torch before it: vLLM's engine and worker processes.
QUIET_WARNINGS = (
    # torch.cuda imports `pynvml`, which warns that it is deprecated in favour of nvidia-ml-py; torch only
    # uses it for device queries.
    ("The pynvml package is deprecated", "FutureWarning", ""),
    # DeepSpeed's ZeRO-3 calls torch.distributed's all_gather_into_tensor and reduce_scatter_tensor, which
    # torch deprecates; the warning came back on every training step (160 of them in a 12-step CPU run).
    ("", "FutureWarning", "torch.distributed.c10d_logger"),
    # torchdata's StatefulDataLoader (OpenRLHF's) calls its own deprecated set_vital, and on a machine
    # without an accelerator says that OpenRLHF's pin_memory=True pins nothing.
    ("'set_vital' is deprecated", "UserWarning", ""),
    ("'pin_memory' argument is set as true but no accelerator is found", "UserWarning", ""),
)


def python_warnings(user_value: str | None = None) -> str:
    """PYTHONWARNINGS that silences QUIET_WARNINGS, followed by the user's own entries (the later wins)."""
    ours = [f"ignore:{message}:{category}:{module}" for message, category, module in QUIET_WARNINGS]
    return ",".join([*ours, *filter(None, [user_value])])


def _ignore_quiet_warnings() -> None:
    """What PYTHONWARNINGS does with python_warnings()'s entries, in this process."""
    for message, category, module in QUIET_WARNINGS:
        module_pattern = re.escape(module) + r"\Z" if module else ""
        warnings.filterwarnings("ignore", re.escape(message), getattr(builtins, category), module_pattern)


_ignore_quiet_warnings()
# bitsandbytes (imported by peft) tries, on CPUs with AVX512-BF16, to fetch a 4-bit CPU kernel from the
# Hugging Face hub and warns when the `kernels` package is missing; this repo never runs 4-bit on CPU.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "gemm_4bit_forward" not in record.getMessage()
)
