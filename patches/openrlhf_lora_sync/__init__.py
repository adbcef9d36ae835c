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
standard library; it silences, at their source, two third-party import messages that need no action here
(below), since every entry point and Ray worker of the patch imports it first.
"""

import logging
import warnings
from pathlib import Path

# The checkout this package sits in (recipes/, data/, rewards/): meaningful for the editable install that
# setup_env.sh makes; a non-editable install resolves recipes relative to the working directory instead.
REPO_ROOT = Path(__file__).resolve().parents[2]

# torch.cuda imports the `pynvml` package, which now warns that it is deprecated in favour of nvidia-ml-py;
# torch only uses it for device queries, and the warning asks nothing of this repo's users.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
# bitsandbytes (imported by peft) tries, on CPUs with AVX512-BF16, to fetch a 4-bit CPU kernel from the
# Hugging Face hub and warns when the `kernels` package is missing; this repo never runs 4-bit on CPU.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "gemm_4bit_forward" not in record.getMessage()
)
