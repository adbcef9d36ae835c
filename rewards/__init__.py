"""Reward functions for OpenRLHF 0.11.2 GRPO, looked up by name.

OpenRLHF loads a reward as a file (``--reward.remote_url path/to/file.py``) that defines
``reward_func(queries, prompts, labels, **kwargs)``, so every registered reward lives in a self-contained
file of this package and ``reward_file(name)`` gives the path a recipe passes on; from a shell,
``python -m rewards NAME`` prints it. ``REWARDS`` maps the same names to the functions, for code that calls
them directly (tests, benchmarks). Scope: rule-based rewards (a final answer checked against the label;
the ASCII-text share the CPU learning run optimizes); no learned reward models.
"""

import inspect
from pathlib import Path

from rewards import ascii_fraction, math_answer

REWARDS = {
    "math_answer": math_answer.reward_func,
    "ascii_fraction": ascii_fraction.reward_func,
}


def reward_file(name: str) -> Path:
    """Path of the file that defines the named reward, for ``--reward.remote_url``."""
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
    return Path(inspect.getsourcefile(REWARDS[name])).resolve()
