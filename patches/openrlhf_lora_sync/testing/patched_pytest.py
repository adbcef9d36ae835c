"""A pytest plugin that applies the patch before collection:
`pytest -p openrlhf_lora_sync.testing.patched_pytest`.

Covers: running another project's tests in a process patched as a run's processes are (OpenRLHF's own
suite, tests/upstream/test_openrlhf_own_suite.py). Does not cover: Ray workers (the launcher's setup hook
patches those, patch/launch.py).
"""

from __future__ import annotations


def pytest_configure(config) -> None:
    from openrlhf_lora_sync.patch.openrlhf_patch import apply

    apply()
