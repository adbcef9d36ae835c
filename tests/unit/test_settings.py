"""settings.py, the one table of repo settings: each setting's parsing, reading and precedence, table-driven.

Fast (no engine, no torch): `pytest tests/unit`. Covers what every reader relies on; the readers themselves
(the patch, the reward, the estimator) are tested where they run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from openrlhf_lora_sync.base import settings


@dataclass(frozen=True)
class Refused:
    fragment: str  # what the SettingError message must say


# (name, value as a recipe or the environment gives it, the typed value, or the message's fragment)
PARSED = [
    ("sync.bucket_mb", 64, 64),  # a YAML int
    ("sync.bucket_mb", "64", 64),  # the variable's text
    ("sync.bucket_mb", 0, Refused("expected an integer >= 1, got 0")),  # zero-sized buckets would never send
    ("sync.bucket_mb", "64.5", Refused("expected an integer >= 1")),
    ("sync.bucket_mb", True, Refused("expected an integer")),  # YAML `yes`/`true` is no size
    ("sync.probe_every", 0, 0),  # 0 is "never", allowed
    ("sync.probe_every", -1, Refused("expected an integer >= 0")),
    ("sync.mode", "adapter", "adapter"),
    ("sync.mode", "lora", Refused("expected one of merge, adapter, got 'lora'")),
    ("sync.mode", "", Refused("empty value")),  # never silently the default
    ("sync.mode", "  ", Refused("empty value")),
    ("sync.vllm_sleep_level", 2, 2),
    ("sync.vllm_sleep_level", 3, Refused("expected one of 1, 2")),
    ("sync.force_full", True, True),
    ("sync.force_full", "1", True),  # what recipe.render writes into the variable
    ("sync.force_full", "0", False),
    ("sync.force_full", "false", False),
    ("sync.force_full", 1, Refused("expected true or false")),  # a YAML number is no switch (as OpenRLHF's)
    ("sync.force_full", "yes", Refused("expected true or false")),
    ("sync.probe_threshold", None, None),  # no default: probe.py picks per dtype
    ("sync.probe_threshold", "0.2", 0.2),
    ("reward.accuracy_weight", 0.5, 0.5),
    ("reward.verify_workers", 0, Refused("expected an integer >= 1")),
    ("reward.answer_format", "think_answer", "think_answer"),
    ("logger.wandb.mode", "offline", "offline"),
    ("sync.transport", [1], Refused("expected one of")),  # a list is never one value
]


@pytest.mark.parametrize(("name", "value", "expected"), PARSED, ids=[f"{n}={v!r}" for n, v, _ in PARSED])
def test_parse(name, value, expected):
    setting = settings.get(name)
    if not isinstance(expected, Refused):
        assert setting.parse(value) == expected
        return
    with pytest.raises(settings.SettingError) as error:
        setting.parse(value)
    assert str(error.value).startswith(f"{name}: ") and expected.fragment in str(error.value)
    assert error.value.key == name


def test_every_setting_has_one_key_and_one_variable_and_a_default_it_accepts():
    keys = [s.key for s in settings.SETTINGS if s.key]
    variables = [s.env for s in settings.SETTINGS]
    assert len(set(keys)) == len(keys) and len(set(variables)) == len(variables)
    for setting in settings.SETTINGS:
        if setting.default is not None:
            assert setting.parse(setting.default) == setting.default, setting.name
        assert setting.kind in (bool, int, float, str) and setting.maps_to
    # Negative control: a key nobody declared.
    with pytest.raises(KeyError, match="settings.SETTINGS"):
        settings.get("sync.bucket_size")


def test_to_env_round_trips_through_read():
    for setting in settings.SETTINGS:
        if setting.default is None:
            continue
        environ = {setting.env: setting.to_env(setting.default)}
        assert settings.read(setting.env, environ) == setting.default
    assert settings.get("sync.force_full").to_env(True) == "1"


def test_read_names_the_variable_and_treats_empty_as_unset():
    assert settings.read("sync.bucket_mb", {}) == 128
    assert settings.read("sync.bucket_mb", {"LORA_SYNC_BUCKET_MB": ""}) == 128  # `VAR=` in a shell
    with pytest.raises(settings.SettingError, match=r"LORA_SYNC_BUCKET_MB='0': expected an integer >= 1"):
        settings.read("sync.bucket_mb", {"LORA_SYNC_BUCKET_MB": "0"})


def test_a_recipe_key_wins_over_the_environment_and_null_falls_back_to_it():
    environ = {"LORA_SYNC_MODE": "adapter"}
    assert settings.resolve("sync.mode", {"sync.mode": "merge"}, environ) == "merge"
    assert settings.resolve("sync.mode", {"sync.mode": None}, environ) == "adapter"
    assert settings.resolve("sync.mode", {}, {}) == "merge"


@pytest.mark.parametrize(
    ("transport", "colocated", "resolved"),
    [
        ("auto", True, "shm"),
        ("auto", False, "broadcast"),
        ("cuda_ipc", True, "cuda_ipc"),
        ("shm", False, "shm"),
    ],
)
def test_auto_transport_resolves_as_the_patch_does(transport, colocated, resolved):
    assert settings.resolved_transport(transport, colocated) == resolved
