"""LoRA-aware policy-to-vLLM weight sync for OpenRLHF, vendored as a run-time patch, and the tools around it.

Installed under its own name by scripts/setup_env.sh (editable), so that every process of a run, Ray
actors and vLLM engine processes included, can import it. The layout and which way imports go are drawn
in the README ("Layout"); each module's docstring says what it covers. Importing this package imports
nothing but the standard library.
"""

from pathlib import Path

# The checkout this package sits in (recipes/, data/, rewards/): meaningful for the editable install that
# setup_env.sh makes; a non-editable install resolves recipes relative to the working directory instead.
REPO_ROOT = Path(__file__).resolve().parents[2]
