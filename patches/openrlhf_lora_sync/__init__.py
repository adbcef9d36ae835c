"""LoRA-aware policy-to-vLLM weight sync for OpenRLHF, vendored as a run-time patch, and the tools around it.

Installed under its own name by scripts/setup_env.sh (editable), so that every process of a run, Ray
actors and vLLM engine processes included, can import it. The layout and which way imports go are drawn
in the README ("Layout"); each module's docstring says what it covers. Importing this package imports
nothing but the standard library; it silences, at their source, two third-party import messages that
need no action here (below), since every entry point and Ray worker of the patch imports it first.
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
