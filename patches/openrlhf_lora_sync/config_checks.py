"""Configuration this patch cannot run, refused before any GPU work, each problem with its fix named.

A run's configuration is its recipe keys / train_ppo_ray flags without dashes (`ds.lora.rank`), plus the
LORA_SYNC_* environment the recipe's repo keys render to; a recipe key wins over the environment, as it
does when scripts/render_recipe.py launches. Callers: scripts/render_recipe.py (the flag-only checks,
no torch), scripts/preflight.py (all of them, against the model's config) and the launcher (flags passed
by hand, before Ray starts).

Covers
- DoRA asked for (a key with "dora" in it): OpenRLHF 0.11.2 has no DoRA option (its LoraConfig never sets
  use_dora) and merge-then-sync cannot merge DoRA; the trainer would also refuse it when built (merge.py).
- A run without LoRA (ds.lora.rank 0 or unset) through this patch: after the first sync only the modules
  LoRA changes are sent, so a full fine-tune's engine would go stale; and OpenRLHF ignores every other
  ds.lora.* key without a rank.
- Rank against the sync mode: adapter mode (LORA_SYNC_MODE / sync.mode) is bounded by vLLM's largest
  max_lora_rank, read from the installed vLLM (adapter_mode.vllm_lora_ranks); merge mode has no limit,
  but a rank above min(in, out) of a target cannot raise its update's rank: a warning, not an error.
- target_modules against the model: the model is built from its config on the meta device (no weights,
  no memory) with the class OpenRLHF's Actor picks, and peft's own `get_peft_model` is run with the
  LoraConfig OpenRLHF builds, so the matching is peft's (list: module-name suffix; a string: regex full
  match; OpenRLHF's default 'all-linear'); no match is an error, and so is whatever the trainer would
  refuse when built: merge.check_supported_adapters (convolutions, embeddings) in merge mode,
  adapter_mode.check_adapter_mode_supported (also: the vision tower, families not verified) in adapter
  mode.
- Trainer base offload (trainer.offload_params / LORA_SYNC_OFFLOAD_PARAMS, offload.py) with a ZeRO stage
  other than 3 (parameter offload is ZeRO-3's; OpenRLHF's default is 2) or with --ds.load_in_4bit
  (bitsandbytes' 4-bit weights are not ZeRO-3 parameters DeepSpeed can offload).
- OpenRLHF/vLLM releases other than the pinned ones (openrlhf_patch.check_versions).
Does not cover: host checks (the transport the host forbids is preflight's `transport` check, which
needs its pidfd_getfd probe), nor whether the model fits (memory_budget.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from openrlhf_lora_sync import offload

SYNC_MODES = ("merge", "adapter")
LORA_OPTION_KEYS = ("ds.lora.alpha", "ds.lora.target_modules", "ds.lora.dropout")
OPENRLHF_DEFAULT_TARGETS = "all-linear"  # train_ppo_ray's --ds.lora.target_modules default
TARGET_LINEAR_FIX = "target linear layers only, by name (ds.lora.target_modules: [q_proj, v_proj, ...])"


@dataclass(frozen=True)
class ConfigProblem:
    key: str  # the recipe key (flag without dashes) at fault
    message: str  # what is wrong and why
    fix: str
    fatal: bool = True  # False: a warning

    def __str__(self) -> str:
        return f"{self.key}: {self.message}; fix: {self.fix}"


class ConfigError(ValueError):
    def __init__(self, problems: list[ConfigProblem]):
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


def setting(flags: Mapping, env: Mapping, key: str, env_name: str, default: str) -> str:
    """A repo setting: the recipe key if given, else its environment variable, else the default."""
    value = flags.get(key)
    return str(value) if value is not None else env.get(env_name) or default


def sync_mode(flags: Mapping, env: Mapping) -> str:
    return setting(flags, env, "sync.mode", "LORA_SYNC_MODE", "merge")


def offload_params(flags: Mapping, env: Mapping) -> bool:
    """trainer.offload_params (true/false in a recipe), else LORA_SYNC_OFFLOAD_PARAMS (1/0)."""
    return setting(flags, env, offload.RECIPE_KEY, offload.ENV, "0") in ("1", "True", "true")


def lora_rank(flags: Mapping) -> int | None:
    """ds.lora.rank as an int (0 when absent: OpenRLHF's default), None when it is not an integer (the
    recipe's type check reports that)."""
    value = flags.get("ds.lora.rank")
    if value is None:
        return 0
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------------- flags only


def dora_problems(flags: Mapping) -> list[ConfigProblem]:
    return [
        ConfigProblem(
            key,
            "DoRA is not supported: OpenRLHF 0.11.2 has no DoRA option (its LoraConfig never sets use_dora) "
            "and merge-then-sync cannot merge DoRA (its magnitude vector rescales by the norm of the merged "
            "weight)",
            f"remove {key} and train plain LoRA (ds.lora.rank, ds.lora.alpha, ds.lora.target_modules)",
        )
        for key, value in flags.items()
        if "dora" in key.lower() and value not in (None, False)
    ]


def non_lora_problems(flags: Mapping, env: Mapping) -> list[ConfigProblem]:
    if lora_rank(flags) != 0:
        return []
    ignored = [key for key in LORA_OPTION_KEYS if flags.get(key) is not None]
    if sync_mode(flags, env) == "adapter":
        ignored.append("sync.mode=adapter")
    why = "ds.lora.rank is 0 (LoRA off): openrlhf_lora_sync is for LoRA runs; after the first sync it sends "
    why += "only the modules LoRA changes, so the engine of a full fine-tune would keep stale weights"
    if ignored:
        why += f", and OpenRLHF ignores {', '.join(ignored)} without a rank"
    return [
        ConfigProblem(
            "ds.lora.rank",
            why,
            "set ds.lora.rank > 0 (e.g. 64) for LoRA; for a full fine-tune run OpenRLHF's own "
            "`python -m openrlhf.cli.train_ppo_ray` without this patch and without the ds.lora.* keys",
        )
    ]


def offload_problems(flags: Mapping, env: Mapping) -> list[ConfigProblem]:
    if not offload_params(flags, env):
        return []
    problems = []
    stage = flags.get("ds.zero_stage")
    if str(stage) != "3":
        shown = "2 (OpenRLHF's default)" if stage is None else stage
        problems.append(
            ConfigProblem(
                offload.RECIPE_KEY,
                f"trainer base offload is ZeRO-3's parameter offload, and ds.zero_stage is {shown}",
                f"set ds.zero_stage: 3, or {offload.RECIPE_KEY}: false",
            )
        )
    if flags.get("ds.load_in_4bit") not in (None, False, "False", "false"):
        problems.append(
            ConfigProblem(
                offload.RECIPE_KEY,
                "trainer base offload cannot move a 4-bit base: bitsandbytes' quantized weights are not "
                "ZeRO-3 parameters DeepSpeed can offload (and merge-then-sync merges LoRA on nn.Linear only)",
                f"remove ds.load_in_4bit, or set {offload.RECIPE_KEY}: false",
            )
        )
    return problems


def flag_problems(flags: Mapping, env: Mapping) -> list[ConfigProblem]:
    """The checks that need only the flags and import nothing heavy (scripts/render_recipe.py runs them)."""
    return [*dora_problems(flags), *non_lora_problems(flags, env), *offload_problems(flags, env)]


def adapter_rank_problems(flags: Mapping, env: Mapping) -> list[ConfigProblem]:
    """Adapter mode: the rank against the installed vLLM's largest max_lora_rank (imports vLLM)."""
    rank = lora_rank(flags)
    if sync_mode(flags, env) != "adapter" or not rank:
        return []
    from openrlhf_lora_sync.adapter_mode import vllm_lora_ranks

    limit = vllm_lora_ranks()[-1]
    if rank <= limit:
        return []
    return [
        ConfigProblem(
            "ds.lora.rank",
            f"rank {rank} is above {limit}, the largest max_lora_rank vLLM {__import__('vllm').__version__} "
            "accepts, so adapter sync mode cannot load the adapter",
            f"lower ds.lora.rank to {limit} or less, or use sync.mode: merge (no rank limit)",
        )
    ]


# ------------------------------------------------------------------------------- against the model


def _meta_model(config):
    """The model OpenRLHF's Actor would load (AutoModelForImageTextToText when the config has a
    vision_config, as openrlhf.utils.is_vlm_model decides, else AutoModelForCausalLM), without weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_class = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        return model_class.from_config(config)


def target_problems(
    flags: Mapping, env: Mapping, model: str, reference: dict | None = None
) -> list[ConfigProblem]:
    """ds.lora.target_modules (and the rank, in merge mode) against `model` (a directory or a cached hub
    id; else `reference`, a config.json dict such as memory_budget.REFERENCE_CONFIGS holds), matched by
    peft on a weightless copy of the model. Nothing to check without LoRA."""
    import copy

    from peft import LoraConfig, TaskType, get_peft_model
    from peft.tuners.lora import LoraLayer
    from peft.utils.error import NoMatchingPeftModuleError
    from torch import nn
    from transformers import AutoConfig

    from openrlhf_lora_sync.adapter_mode import check_adapter_mode_supported
    from openrlhf_lora_sync.merge import UnsupportedAdapterError, check_supported_adapters

    rank = lora_rank(flags)
    if not rank:
        return []
    targets = flags.get("ds.lora.target_modules")
    targets = OPENRLHF_DEFAULT_TARGETS if targets is None else targets
    targets = [targets] if isinstance(targets, str) and targets != OPENRLHF_DEFAULT_TARGETS else targets
    key = "ds.lora.target_modules"
    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as error:
        if reference is None:
            message = f"not checked: no model config for {model} here ({error})".splitlines()[0]
            return [ConfigProblem(key, message, "check the model path (preflight: model)", fatal=False)]
        config = AutoConfig.for_model(**copy.deepcopy(reference))
    base = _meta_model(config)
    leaves = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, nn.Linear)}
    linear_names = sorted(leaf for leaf in leaves if not leaf.isdigit())  # not nn.Sequential indices
    lora_config = LoraConfig(  # what OpenRLHF's Actor builds
        task_type=TaskType.CAUSAL_LM,
        r=rank,
        lora_alpha=int(flags.get("ds.lora.alpha") or 16),
        target_modules=targets,
        lora_dropout=float(flags.get("ds.lora.dropout") or 0),
        bias="none",
    )
    try:
        peft_model = get_peft_model(base, lora_config)
    except NoMatchingPeftModuleError:
        return [
            ConfigProblem(
                key,
                f"{targets} matches no module of {model} ({config.model_type}); peft matches a list entry "
                "as a module-name suffix ('q_proj', 'layers.0.mlp.gate_proj'), never as a regex",
                f"list module names of this model; its linear layers are named {', '.join(linear_names)}",
            )
        ]
    except ValueError as error:  # peft refuses a matched module type it has no LoRA layer for
        return [ConfigProblem(key, f"peft refuses {targets} on {model}: {error}", TARGET_LINEAR_FIX)]
    adapter_mode = sync_mode(flags, env) == "adapter"
    try:  # what the trainer refuses when it is built, on the weightless model
        (check_adapter_mode_supported if adapter_mode else check_supported_adapters)(peft_model)
    except UnsupportedAdapterError as error:
        fix = "the message names it" if adapter_mode else TARGET_LINEAR_FIX
        return [ConfigProblem(key, f"{targets} on {model}: {error}", fix)]
    if adapter_mode:
        return []
    capped = [
        (name, min(layer.in_features, layer.out_features))
        for name, layer in peft_model.named_modules()
        if isinstance(layer, LoraLayer) and min(layer.in_features, layer.out_features) < rank
    ]
    if not capped:
        return []
    smallest = min(dim for _, dim in capped)
    return [
        ConfigProblem(
            "ds.lora.rank",
            f"rank {rank} is above min(in, out) of {len(capped)} targeted layers (smallest {smallest}), "
            "where the update's rank cannot exceed that: the extra rank costs memory and does nothing",
            f"ds.lora.rank: {smallest} or less",
            fatal=False,
        )
    ]


def version_problems(installed: dict[str, str] | None = None) -> list[ConfigProblem]:
    from openrlhf_lora_sync.openrlhf_patch import UnsupportedVersionError, check_versions

    try:
        check_versions(installed)
    except UnsupportedVersionError as error:
        return [ConfigProblem("versions", str(error), "bash scripts/setup_env.sh")]
    return []


# -------------------------------------------------------------------------------------- launcher


def flags_from_argv(argv: list[str]) -> dict:
    """train_ppo_ray flags as recipe keys: `--a.b v` -> {"a.b": "v"}, several values -> a list, a bare
    switch -> True. Values stay strings, as argparse would receive them."""
    flags: dict = {}
    key = None
    for token in argv:
        if token.startswith("--"):
            key, sep, value = token[2:].partition("=")
            flags[key] = value if sep else True
        elif key is not None:
            current = flags[key]
            if current is True:
                flags[key] = token
            else:
                flags[key] = [*(current if isinstance(current, list) else [current]), token]
    targets = flags.get("ds.lora.target_modules")
    if targets is not None and not isinstance(targets, list):  # nargs="*": always a list
        flags["ds.lora.target_modules"] = [] if targets is True else [targets]
    return flags


def launch_problems(
    argv: list[str], env: Mapping, installed: dict[str, str] | None = None
) -> list[ConfigProblem]:
    """Every check on the launcher's train_ppo_ray flags; the model is checked when its config is here."""
    flags = flags_from_argv(argv)
    problems = [*version_problems(installed), *flag_problems(flags, env)]
    if any(p.fatal for p in problems):
        return problems
    problems += adapter_rank_problems(flags, env)
    model = flags.get("actor.model_name_or_path")
    if isinstance(model, str) and not any(p.fatal for p in problems):
        problems += target_problems(flags, env, model)
    return problems
