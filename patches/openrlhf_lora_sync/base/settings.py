"""This repo's own settings, each written once: recipe key, environment variable, type, choices, bounds,
default and what it changes. Standard library only (no torch, no yaml): the recipe renderer, the config
checks, preflight, the memory estimator, the launcher, the patch in every Ray worker and the reward file
all read it.

A recipe sets a setting by its key (`sync.bucket_mb: 64`); recipe.render turns it into the environment
variable (`LORA_SYNC_BUCKET_MB=64`), which the launcher forwards to every Ray worker and which the
run-time code reads with `read()`. A recipe key wins over the environment (`resolve()`), as it does when
recipe.py launches. Values are checked the same way wherever they come from (`parse()`): type, choices,
lower bound, and an empty value is refused rather than dropped.

Covers: the settings OpenRLHF does not have (sync, trainer offload, KL reference, reward weights, the
default data's source, wandb mode) and the three the launcher sets for the workers (LORA_SYNC_LORA_RANK,
LORA_SYNC_RUN_ID, LORA_SYNC_WORKDIR).
Does not cover: OpenRLHF's own flags, which its parser checks (recipe.py runs it), nor checks that need
several settings or the model (config_checks.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TRUE_WORDS = ("1", "true")
FALSE_WORDS = ("0", "false")


class SettingError(ValueError):
    """A value a setting does not accept; `key` is the recipe key (or the variable, for launcher-set ones)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Setting:
    key: str | None  # recipe key; None: set by the launcher only
    env: str  # the environment variable it renders to and is read from
    kind: type  # bool, int, float or str
    default: object  # None: no default (the reader decides, e.g. the probe's threshold per dtype)
    maps_to: str  # what it changes, for people (README and recipe comments point here)
    choices: tuple = ()
    minimum: float | None = None  # inclusive lower bound of an int/float

    @property
    def name(self) -> str:
        return self.key or self.env

    def expected(self) -> str:
        if self.kind is bool:
            return "true or false"
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        bound = f" >= {self.minimum:g}" if self.minimum is not None else ""
        return f"{'an integer' if self.kind is int else 'a number' if self.kind is float else 'text'}{bound}"

    def parse(self, value, shown_as: str | None = None):
        """A recipe value (YAML-typed) or an environment string -> the typed value; None -> the default.
        Raises SettingError naming the key (or `shown_as`, e.g. "VAR='x'"), the value and what it accepts."""
        if value is None:
            return self.default
        label = shown_as or self.name
        wrong = SettingError(f"{label}: expected {self.expected()}, got {value!r}", self.name)
        text = str(value).strip()
        if text == "":
            raise SettingError(
                f"{label}: empty value; give {self.expected()}, or null (recipe) / unset the variable "
                f"for the default ({self.default!r})",
                self.name,
            )
        if self.kind is bool:
            # true/false in a recipe; the variable's 1/0 (or true/false) as text; never a bare number.
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and text.lower() in TRUE_WORDS + FALSE_WORDS:
                return text.lower() in TRUE_WORDS
            raise wrong
        if isinstance(value, bool | list | dict):
            raise wrong
        try:
            converted = self.kind(text)
        except ValueError:
            raise wrong from None
        if self.choices and converted not in self.choices:
            raise wrong
        if self.minimum is not None and converted < self.minimum:
            raise wrong
        return converted

    def to_env(self, value) -> str:
        """The typed value as its environment variable carries it (booleans as 1/0)."""
        value = self.parse(value)
        return ("1" if value else "0") if self.kind is bool else str(value)


SYNC_MODES = ("merge", "adapter")
TRANSPORTS = ("auto", "shm", "cuda_ipc", "broadcast")
SLEEP_LEVELS = (1, 2)
ANSWER_FORMATS = ("boxed", "think_answer")
WANDB_MODES = ("auto", "online", "offline", "disabled")

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "sync.mode",
        "LORA_SYNC_MODE",
        str,
        "merge",
        "merge: vLLM gets merged weights; adapter: vLLM keeps the base and hot-swaps the adapter "
        "(adapter_mode.py)",
        choices=SYNC_MODES,
    ),
    Setting(
        "sync.transport",
        "LORA_SYNC_TRANSPORT",
        str,
        "auto",
        "auto: broadcast (NCCL; gloo on CPU) to engines on another Ray node than trainer rank 0, else "
        "/dev/shm when colocated or the trainer has no CUDA, else broadcast; cuda_ipc is opt-in "
        "(resolved_transport, transport.py)",
        choices=TRANSPORTS,
    ),
    Setting(
        "sync.bucket_mb",
        "LORA_SYNC_BUCKET_MB",
        int,
        128,
        "MiB of tensors per handoff to the engines (bucket.py); /dev/shm holds two buckets",
        minimum=1,
    ),
    Setting(
        "sync.force_full", "LORA_SYNC_FORCE_FULL", bool, False, "every sync sends every tensor (plan.py)"
    ),
    Setting(
        "sync.stale_engine_control",
        "LORA_SYNC_STALE_ENGINE_CONTROL",
        bool,
        False,
        "a control for experiments: after the first full sync the engines are never synced again (nor "
        "probed), so rollouts keep coming from that policy while the trainer goes on; its reward should not "
        "rise (the CPU learning run's control)",
    ),
    Setting(
        "sync.vllm_sleep_level",
        "LORA_SYNC_VLLM_SLEEP_LEVEL",
        int,
        1,
        "1: vLLM keeps its weights in host RAM while asleep; 2: discards them (every sync is then full)",
        choices=SLEEP_LEVELS,
    ),
    Setting(
        "sync.probe_every",
        "LORA_SYNC_PROBE_EVERY",
        int,
        1,
        "post-sync probe after every Nth sync, 0: never (probe.py)",
        minimum=0,
    ),
    Setting(
        "sync.probe_threshold",
        "LORA_SYNC_PROBE_THRESHOLD",
        float,
        None,
        "a fixed threshold on the probe's max abs logprob difference, in place of the ratio to the floor "
        "measured before the first sync (probe.py); null: the ratio",
        minimum=0,
    ),
    Setting(
        "sync.gen_kl_gate",
        "LORA_SYNC_GEN_KL_GATE",
        float,
        1e-3,
        "a warning when a rollout step's mean gen-KL (engine vs trainer log-probs of the sampled tokens, "
        "parity/gen_kl) is above this; 0: off (openrlhf_patch.gen_kl_gate)",
        minimum=0,
    ),
    Setting(
        "sync.gen_kl_stop",
        "LORA_SYNC_GEN_KL_STOP",
        bool,
        False,
        "end the run at the first rollout step over sync.gen_kl_gate instead of warning",
    ),
    Setting(
        "sync.reference_from_base",
        "LORA_SYNC_REFERENCE_FROM_BASE",
        bool,
        True,
        "the KL reference is the policy with its adapters disabled, no reference model (reference_policy.py)",
    ),
    Setting(
        "sync.allow_untested_versions",
        "LORA_SYNC_ALLOW_UNTESTED_VERSIONS",
        bool,
        False,
        "an OpenRLHF, vLLM, peft or DeepSpeed release outside versions.toml's [supported] ranges is run with "
        "a warning instead of refused (pins.check_versions)",
    ),
    Setting(
        "trainer.offload_params",
        "LORA_SYNC_OFFLOAD_PARAMS",
        bool,
        False,
        "the policy's ZeRO-3 parameters and optimizer in pinned host memory (offload.py)",
    ),
    Setting(
        "reward.accuracy_weight",
        "REWARD_ACCURACY_WEIGHT",
        float,
        1.0,
        "weight of the 0/1 accuracy term (rewards/math_answer.py)",
    ),
    Setting(
        "reward.format_weight",
        "REWARD_FORMAT_WEIGHT",
        float,
        0.1,
        "weight of the 0/1 format term (rewards/math_answer.py)",
    ),
    Setting(
        "reward.answer_format",
        "REWARD_ANSWER_FORMAT",
        str,
        "boxed",
        "the final-answer format the prompt asks for and the reward parses (rewards/math_answer.py)",
        choices=ANSWER_FORMATS,
    ),
    Setting(
        "reward.verify_timeout_s",
        "REWARD_VERIFY_TIMEOUT_S",
        float,
        5.0,
        "wall-clock bound on verifying one sample (rewards/math_answer.py)",
        minimum=0.01,
    ),
    Setting(
        "reward.verify_workers",
        "REWARD_VERIFY_WORKERS",
        int,
        2,
        "verifier subprocesses per process that loads the reward (rewards/math_answer.py)",
        minimum=1,
    ),
    Setting(
        "data.source",
        "DATA_SOURCE",
        str,
        "hiyouga/geometry3k",
        "what scripts/run_grpo_lora.sh converts (tools/prepare_data.py) into data/geometry3k/ when the run's "
        "data lies there and is missing: a hub dataset id, a parquet file, a folder of parquet files or a "
        "save_to_disk folder (a local copy where the hub is out of reach)",
    ),
    Setting(
        "logger.wandb.mode",
        "WANDB_MODE",
        str,
        "auto",
        "auto: the shell's WANDB_MODE, else online with an API key, else offline (recipe.py)",
        choices=WANDB_MODES,
    ),
    Setting(
        None,
        "LORA_SYNC_LORA_RANK",
        int,
        0,
        "the trainer's LoRA rank for the workers (adapter-mode engines, the KL reference); the launcher sets "
        "it from --ds.lora.rank",
        minimum=0,
    ),
    Setting(
        None,
        "LORA_SYNC_RUN_ID",
        str,
        "norun",
        "names this run's /dev/shm bucket files; the launcher sets it and removes them at the end",
    ),
    Setting(
        None,
        "LORA_SYNC_WORKDIR",
        str,
        None,
        "the launcher's working directory, which every Ray worker of the run enters (openrlhf_patch.apply) "
        "where it exists, so relative paths inside the data (image paths) open in the actors as in the "
        "driver; the launcher sets it",
    ),
)

BY_KEY = {s.key: s for s in SETTINGS if s.key}
BY_ENV = {s.env: s for s in SETTINGS}


def get(name: str) -> Setting:
    """The setting of a recipe key or an environment variable name."""
    found = BY_KEY.get(name) or BY_ENV.get(name)
    if found is None:
        raise KeyError(f"{name}: not a setting of this repo (settings.SETTINGS)")
    return found


def read(name: str, environ: Mapping[str, str] | None = None):
    """A setting's typed value from the environment (unset or empty: the default). What the run-time
    code calls; a bad value raises SettingError naming the variable."""
    setting = get(name)
    environ = os.environ if environ is None else environ
    raw = environ.get(setting.env, "")
    return setting.default if raw == "" else setting.parse(raw, shown_as=f"{setting.env}={raw!r}")


def resolve(name: str, flags: Mapping, environ: Mapping[str, str] | None = None):
    """A setting for a run: the recipe key if the flags set it (not null), else the environment, else the
    default."""
    setting = get(name)
    if setting.key and flags.get(setting.key) is not None:
        return setting.parse(flags[setting.key])
    return read(name, environ)


def resolved_transport(
    transport: str,
    colocated: bool,
    *,
    trainer_node: str | None = None,
    engine_nodes: Iterable[str] = (),
    trainer_cuda: bool = True,
) -> str:
    """sync.transport with `auto` resolved; the one place the rule is written (the patch's sync_transport
    and the memory estimator call it):
    - "broadcast" when any engine actor's Ray node id (engine_nodes) differs from trainer rank 0's
      (trainer_node): /dev/shm files reach only the node they are written on. Node ids, not hostnames:
      two Ray nodes on one host (tests/sync/test_two_node.py) are two nodes;
    - else "shm" when the engines are colocated with the trainer, or the trainer has no CUDA (one CPU
      host: a file in /dev/shm costs less than a gloo broadcast);
    - else "broadcast" (engines on their own GPUs of this node: NCCL).
    Without node ids (trainer_node None: callers without Ray) no engine counts as elsewhere, and
    trainer_cuda defaults to True: shm when colocated, else broadcast, as before node ids were asked."""
    if transport != "auto":
        return transport
    if trainer_node is not None and any(node != trainer_node for node in engine_nodes):
        return "broadcast"
    return "shm" if colocated or not trainer_cuda else "broadcast"
