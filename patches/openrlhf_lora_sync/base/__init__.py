"""The ground floor: the facts every other part reads, standard library only.

- settings: every repo setting once (recipe key, environment variable, type, choices, default, effect).
- pins: versions.toml's pins (the packaged `versions.toml` beside it) and the installed-version check;
  runnable as a file, before any virtual environment exists (scripts/setup_env.sh).
- upstream: facts about the installed vLLM, read from its source without importing it.

Imports: nothing of this package outside `base` (the top-level `openrlhf_lora_sync`, standard library
only, loads first as always). Every other group and rewards/ may import it.
"""
