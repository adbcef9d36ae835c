"""Configuration this patch cannot run, refused before any GPU work, each problem with its fix named.

A run is a recipe.Run: OpenRLHF's own parsed arguments (`run.args.ds.lora.rank`, its defaults filled
in), the recipe keys as given (`run.flags`) and this repo's settings (`run.setting("sync.mode")`, the
recipe key winning over the environment: settings.resolve). recipe.load_run and recipe.run_from_argv
(the launcher) run `run_problems` on every run, so render, --dry-run, preflight, memory_budget, the
launcher and the CPU runs refuse the same things with the same words; preflight and the launcher add
the checks against the model's config and the installed versions.

Covers
- DoRA asked for (a key with "dora" in it): OpenRLHF 0.11.2 has no DoRA option (its LoraConfig never sets
  use_dora) and merge-then-sync cannot merge DoRA; the trainer would also refuse it when built (merge.py).
- A run without LoRA (ds.lora.rank 0 or unset) through this patch: after the first sync only the modules
  LoRA changes are sent, so a full fine-tune's engine would go stale; and OpenRLHF ignores every other
  ds.lora.* key without a rank.
- A negative rank. Rank against the sync mode: adapter mode (sync.mode) is bounded by vLLM's largest
  max_lora_rank, read from the installed vLLM's source (vllm_lora_ranks); merge mode has no limit,
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
- sync.stale_engine_control (a control for experiments) with vLLM sleep level 2, which discards the
  weights the control keeps.
- Adapter mode on Qwen3.5 (a warning): upstream vLLM reports it broken on GPUs (#49354, #47639; what has
  been checked here: docs/fidelity.md).
- data.max_len (train_ppo_ray.py:53 passes it to vLLM as max_model_len) above the model's
  max_position_embeddings: vLLM refuses that inside its engine actor, after the trainer has loaded.
- OpenRLHF, vLLM, peft or DeepSpeed releases outside versions.toml's [supported] (pins.check_versions).
Does not cover: host checks (the transport the host forbids is preflight's `transport` check, which
needs its pidfd_getfd probe), nor whether the model fits (memory_budget.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from openrlhf_lora_sync.base.upstream import vllm_lora_ranks

OFFLOAD_KEY = "trainer.offload_params"
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


# ------------------------------------------------------------------------------------- flags only


def dora_problems(keys: Iterable[str], values=None) -> list[ConfigProblem]:
    """Keys asking for DoRA (recipe keys, or flags of the launcher's argv). `values` (key -> value) lets a
    recipe turn one off with false/null."""
    values = values or {}
    return [
        ConfigProblem(
            key,
            "DoRA is not supported: OpenRLHF 0.11.2 has no DoRA option (its LoraConfig never sets use_dora) "
            "and merge-then-sync cannot merge DoRA (its magnitude vector rescales by the norm of the merged "
            "weight)",
            f"remove {key} and train plain LoRA (ds.lora.rank, ds.lora.alpha, ds.lora.target_modules)",
        )
        for key in keys
        if "dora" in key.lower() and values.get(key, True) not in (None, False)
    ]


def rank_problems(run) -> list[ConfigProblem]:
    """ds.lora.rank against the patch: LoRA off (0) or a negative rank; in adapter mode, above vLLM's
    largest max_lora_rank."""
    lora = run.args.ds.lora
    rank, mode = lora.rank, run.setting("sync.mode")
    if rank < 0:
        return [ConfigProblem("ds.lora.rank", f"{rank} is negative", "set ds.lora.rank > 0 (e.g. 64)")]
    if rank == 0:
        options = ("ds.lora.alpha", "ds.lora.target_modules", "ds.lora.dropout")
        ignored = [key for key in options if run.flags.get(key) is not None]
        if mode == "adapter":
            ignored.append("sync.mode=adapter")
        why = (
            "ds.lora.rank is 0 (LoRA off): openrlhf_lora_sync is for LoRA runs; after the first sync it "
            "sends only the modules LoRA changes, so the engine of a full fine-tune would keep stale weights"
        )
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
    accepted = vllm_lora_ranks()
    if mode != "adapter" or not accepted or rank <= accepted[-1]:
        return []
    return [
        ConfigProblem(
            "ds.lora.rank",
            f"rank {rank} is above {accepted[-1]}, the largest max_lora_rank the installed vLLM accepts "
            f"({', '.join(map(str, accepted))}), so adapter sync mode cannot load the adapter",
            f"lower ds.lora.rank to {accepted[-1]} or less, or use sync.mode: merge (no rank limit)",
        )
    ]


def offload_problems(run) -> list[ConfigProblem]:
    if not run.setting(OFFLOAD_KEY):
        return []
    problems = []
    stage = run.args.ds.zero_stage
    if stage != 3:
        shown = f"{stage} (OpenRLHF's default)" if "ds.zero_stage" not in run.flags else stage
        problems.append(
            ConfigProblem(
                OFFLOAD_KEY,
                f"trainer base offload is ZeRO-3's parameter offload, and ds.zero_stage is {shown}",
                f"set ds.zero_stage: 3, or {OFFLOAD_KEY}: false",
            )
        )
    if run.args.ds.load_in_4bit:
        problems.append(
            ConfigProblem(
                OFFLOAD_KEY,
                "trainer base offload cannot move a 4-bit base: bitsandbytes' quantized weights are not "
                "ZeRO-3 parameters DeepSpeed can offload (and merge-then-sync merges LoRA on nn.Linear only)",
                f"remove ds.load_in_4bit, or set {OFFLOAD_KEY}: false",
            )
        )
    return problems


def control_problems(run) -> list[ConfigProblem]:
    """sync.stale_engine_control keeps the engine's first-sync weights; vLLM sleep level 2 discards them at
    every sleep, so without a sync after each wake-up the control would sample from lost weights."""
    key = "sync.stale_engine_control"
    if not (run.setting(key) and run.args.vllm.enable_sleep and run.setting("sync.vllm_sleep_level") == 2):
        return []
    return [
        ConfigProblem(
            key,
            "the control keeps the engine's weights of its first sync, and vLLM sleep level 2 discards the "
            "engine's weights at every sleep (only a sync restores them)",
            "set sync.vllm_sleep_level: 1 (or vllm.enable_sleep: false) for the control run",
        )
    ]


def run_problems(run) -> list[ConfigProblem]:
    """The checks that need only the parsed run (recipe.Run: OpenRLHF's args and this repo's settings) and
    import nothing heavy; recipe.load_run and recipe.run_from_argv run them on every run."""
    return [*rank_problems(run), *offload_problems(run), *control_problems(run)]


# ------------------------------------------------------------------------------- against the model


def meta_model(config):
    """The model OpenRLHF's Actor would load (AutoModelForImageTextToText when the config has a
    vision_config, as openrlhf.utils.is_vlm_model decides, else AutoModelForCausalLM), without weights.
    `config`: a transformers config, or a config.json dict (model_type included)."""
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if isinstance(config, dict):
        config = AutoConfig.for_model(**copy.deepcopy(config))
    model_class = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        return model_class.from_config(config)


def openrlhf_lora_config(rank: int, alpha: int | None, targets, dropout: float | None):
    """The peft LoraConfig OpenRLHF's Actor builds from --ds.lora.rank/alpha/target_modules/dropout
    (None: OpenRLHF's defaults, alpha 16, dropout 0, targets 'all-linear')."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=rank,
        lora_alpha=int(alpha or 16),
        target_modules=OPENRLHF_DEFAULT_TARGETS if targets is None else targets,
        lora_dropout=float(dropout or 0),
        bias="none",
    )


def target_problems(run, model: str, reference: dict | None = None) -> list[ConfigProblem]:
    """ds.lora.target_modules (and the rank, in merge mode) against `model` (a directory or a cached hub
    id; else `reference`, a config.json dict such as model_inventory.REFERENCE_CONFIGS holds), matched by
    peft on a weightless copy of the model. Nothing to check without LoRA."""
    import copy

    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer
    from torch import nn
    from transformers import AutoConfig

    from openrlhf_lora_sync.sync.adapter_mode import check_adapter_mode_supported
    from openrlhf_lora_sync.sync.merge import UnsupportedAdapterError, check_supported_adapters
    from openrlhf_lora_sync.sync.upstream_versions import is_no_matching_module_error

    lora = run.args.ds.lora
    rank = lora.rank
    if rank <= 0:
        return []
    targets = lora.target_modules
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
    base = meta_model(config)
    leaves = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, nn.Linear)}
    linear_names = sorted(leaf for leaf in leaves if not leaf.isdigit())  # not nn.Sequential indices
    lora_config = openrlhf_lora_config(rank, lora.alpha, targets, lora.dropout)
    try:
        peft_model = get_peft_model(base, lora_config)
    except ValueError as error:
        if not is_no_matching_module_error(error):  # peft refuses a matched module type it has no LoRA for
            return [ConfigProblem(key, f"peft refuses {targets} on {model}: {error}", TARGET_LINEAR_FIX)]
        return [
            ConfigProblem(
                key,
                f"{targets} matches no module of {model} ({config.model_type}); peft matches a list entry "
                "as a module-name suffix ('q_proj', 'layers.0.mlp.gate_proj'), never as a regex",
                f"list module names of this model; its linear layers are named {', '.join(linear_names)}",
            )
        ]
    adapter_mode = run.setting("sync.mode") == "adapter"
    try:  # what the trainer refuses when it is built, on the weightless model
        (check_adapter_mode_supported if adapter_mode else check_supported_adapters)(peft_model)
    except UnsupportedAdapterError as error:
        fix = "the message names it" if adapter_mode else TARGET_LINEAR_FIX
        return [ConfigProblem(key, f"{targets} on {model}: {error}", fix)]
    if adapter_mode:
        return adapter_mode_warnings(config.model_type)
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


def adapter_mode_warnings(model_type: str) -> list[ConfigProblem]:
    """Adapter mode where upstream vLLM reports it broken on GPUs and no GPU run here has shown otherwise."""
    if model_type != "qwen3_5":
        return []
    return [
        ConfigProblem(
            "sync.mode",
            "adapter mode on Qwen3.5 has not run on a GPU here, and upstream vLLM reports its LoRA as a "
            "no-op for Qwen3.5 on GPUs (vllm-project/vllm#49354) and a crash with LoRA on part of its linear-"
            "attention (GDN) projections (vllm-project/vllm#47639); on CPU the sync matches vLLM's own load "
            "of the adapter exactly (docs/fidelity.md)",
            "sync.mode: merge, or check first: python scripts/verify_sync.py --model DIR --mode adapter on "
            "the GPU (ok, with before_diff large, means vLLM applies the adapter)",
            fatal=False,
        )
    ]


def length_problems(run, model: str) -> list[ConfigProblem]:
    """data.max_len against the model's max_position_embeddings (its text config's, for a VLM), when the
    model's config is here; vLLM refuses a max_model_len above it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        return []  # target_problems reports the missing config
    text_config = getattr(config, "text_config", None) or config
    limit = getattr(text_config, "max_position_embeddings", None)
    max_len = run.args.data.max_len
    if limit is None or max_len is None or max_len <= limit:
        return []
    return [
        ConfigProblem(
            "data.max_len",
            f"{max_len} is above {model}'s max_position_embeddings {limit}, and OpenRLHF gives data.max_len "
            "to vLLM as max_model_len, which vLLM refuses above the model's length",
            f"data.max_len: {limit} or less",
        )
    ]


def version_problems(
    installed: dict[str, str] | None = None, allow_untested: bool | None = None
) -> list[ConfigProblem]:
    from openrlhf_lora_sync.base.pins import UnsupportedVersionError, check_versions

    try:
        check_versions(installed, allow_untested)
    except UnsupportedVersionError as error:
        return [ConfigProblem("versions", str(error), "bash scripts/setup_env.sh")]
    return []


# -------------------------------------------------------------------------------------- launcher


def launch_problems(run, installed: dict[str, str] | None = None) -> list[ConfigProblem]:
    """The launcher's checks beyond recipe.run_from_argv's: the versions, and the targets against the
    model when its config is here (a hub id not yet downloaded is checked by preflight's warning only)."""
    problems = version_problems(installed, run.setting("sync.allow_untested_versions"))
    model = run.args.actor.model_name_or_path
    if isinstance(model, str) and not problems:
        problems += [*length_problems(run, model), *target_problems(run, model)]
    return problems
