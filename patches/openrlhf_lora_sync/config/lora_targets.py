"""LoRA targets named by rule: `ds.lora.target_modules: language-linears` in a recipe, expanded into the
module-name list OpenRLHF's --ds.lora.target_modules passes to peft unchanged.

    names, note = expand("language-linears", "Qwen/Qwen2.5-VL-7B-Instruct")  # [q_proj, ..., layers.27...]

Covers: the rules (RULES), each a set of nn.Linear modules of the language model's decoder layers of the
model OpenRLHF's Actor builds from the model's config (config_checks.meta_model: the local or cached
config.json, else model_inventory.REFERENCE_CONFIGS), written as the shortest module-name suffixes that
reach those modules and nothing else, then checked with peft's own matcher. OpenRLHF's flag is nargs="*",
so peft always gets a list (suffix match), never a regex: Qwen2.5-VL's vision MLPs share gate_proj/up_proj/
down_proj with the language model, so there those are named per decoder layer (`layers.N.mlp.gate_proj`).
Does not cover: whether peft and the sync accept the targets (config_checks.target_problems).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from openrlhf_lora_sync.config import config_checks, model_inventory

KEY = "ds.lora.target_modules"
# Rule name -> the decoder-layer submodules (`layers.N.<part>.`) whose linears it adapts; None: all of them.
RULES = {
    "language-linears": None,  # every linear of the decoder layers: attention, linear attention, MLP
    "language-attention": ("self_attn", "linear_attn"),  # attention and Qwen3.5's linear-attention only
    "language-mlp": ("mlp",),  # the MLPs only
}


class TargetRuleError(ValueError):
    """A rule that cannot be expanded: an unknown name, or no config for the model."""


def is_rule(value) -> bool:
    """A rule name, or a name written like one (module names never hold a hyphen; 'all-linear' is peft's)."""
    return isinstance(value, str) and "-" in value and value != config_checks.OPENRLHF_DEFAULT_TARGETS


def _config(model: str, rule: str):
    """The model's transformers config: a local directory or the Hugging Face cache, else a reference
    config by hub id; (config, where it came from)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, local_files_only=True), "its config.json"
    except (OSError, ValueError):
        pass
    if model in model_inventory.REFERENCE_CONFIGS:
        return model_inventory.REFERENCE_CONFIGS[model], "the reference config in model_inventory.py"
    raise TargetRuleError(
        f"{model}: no config.json there (a directory, the Hugging Face cache) nor a reference config "
        f"({', '.join(sorted(model_inventory.REFERENCE_CONFIGS))}), and {KEY}: {rule} is expanded on it; "
        f"fetch it (hf download {model} config.json) or list module names"
    )


def _matches(suffix: str, name: str) -> bool:
    """peft's rule for a target_modules list entry: the module name itself or a dotted suffix of it."""
    return name == suffix or name.endswith("." + suffix)


@functools.cache
def _expand(rule: str, config_json: str) -> tuple[str, ...]:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from torch import nn

    model = config_checks.meta_model(json.loads(config_json))
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder) + ".layers."
    names = [name for name, _ in model.named_modules()]
    parts = RULES[rule]
    chosen = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.startswith(prefix)
        and (parts is None or name.removeprefix(prefix).split(".")[1] in parts)
    ]
    wanted, suffixes = set(chosen), []
    for name in chosen:
        if any(_matches(suffix, name) for suffix in suffixes):
            continue
        pieces = name.split(".")
        for start in range(len(pieces) - 1, -1, -1):  # the shortest suffix that reaches only `wanted`
            suffix = ".".join(pieces[start:])
            if all(other in wanted for other in names if _matches(suffix, other)):
                suffixes.append(suffix)
                break
    lora = LoraConfig(target_modules=suffixes)
    reached = {name for name in names if check_target_module_exists(lora, name)}
    if reached != wanted:  # peft's own matcher has the last word
        raise TargetRuleError(
            f"{KEY}: {rule}: the suffixes reach {len(reached)} modules, not the {len(wanted)}"
        )
    return tuple(suffixes)


def expand(rule: str, model: str | Path) -> tuple[list[str], str]:
    """The module-name list `rule` stands for on `model` (a directory or a hub id), and a note saying what
    it was built from. Raises TargetRuleError naming the rules, or how to get the model's config."""
    if rule not in RULES:
        raise TargetRuleError(
            f"{KEY}: {rule!r} is not a target rule; the rules: {', '.join(RULES)} (or list module names)"
        )
    config, source = _config(str(model), rule)
    config_json = json.dumps(config if isinstance(config, dict) else config.to_dict(), sort_keys=True)
    suffixes = list(_expand(rule, config_json))
    return suffixes, f"{rule} -> {len(suffixes)} names on {model} (from {source})"
