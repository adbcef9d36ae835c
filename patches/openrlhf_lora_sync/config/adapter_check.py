"""Refuse a peft adapter that does not fit its base model, instead of loading it as a silent no-op.

peft's `PeftModel.from_pretrained` only warns when the adapter's keys miss the base (a Qwen2 adapter on a
Qwen2.5-VL base loads nothing: its `model.layers.*` keys are not the VLM's `model.language_model.layers.*`)
and says nothing of adapter keys that land nowhere; the model then computes the base alone.
`load_checked_adapter` loads through peft's own `load_adapter` and refuses, naming the keys:
- unexpected keys: adapter tensors with no LoRA module of the base to go to;
- missing keys: LoRA modules peft created on the base (from the adapter's target_modules) that the
  adapter file has no tensor for;
- shapes that do not fit (peft / torch raise; the message is reworded with the keys);
- target_modules matching no module of the base (peft raises; reworded).
`check_adapter_dir`, before any weights are loaded, refuses a missing directory, one without
adapter_config.json, an adapter file that cannot be read (weights_check.py), and an adapter whose
`base_model_name_or_path` names another model type, when that can be told offline: a local directory
with config.json, a hub id whose config.json is in the local Hugging Face cache, or a hub id whose name
names a Qwen family (`Qwen/Qwen2-7B` is qwen2). A name that says nothing (a path that no longer
exists, another vendor's id) is not refused on its name: the key check still runs.

Used by scripts/verify_sync.py and scripts/export_merged.py. Does not cover: whether the adapter was
trained on these exact weights (a fine-tuned base of the same shapes passes every check here).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Adapter keys named in a refusal; the rest are counted.
SHOWN_KEYS = 4

# Qwen hub names -> model type, most specific first (Qwen2.5-VL before Qwen2.5, Qwen3-VL before Qwen3).
_NAMED_FAMILIES = (
    (r"qwen2\.5-?vl", "qwen2_5_vl"),
    (r"qwen2-?vl", "qwen2_vl"),
    (r"qwen3-?vl", "qwen3_vl"),
    (r"qwen3\.5", "qwen3_5"),
    (r"qwen3(?![.\d])", "qwen3"),
    (r"qwen2(\.5)?(?![.\d])", "qwen2"),
)
# Words in a Qwen name that mean another architecture than the family the version number suggests.
_OTHER_ARCHITECTURES = re.compile(r"omni|audio|embedding|reranker|guard|next")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class AdapterMismatchError(ValueError):
    """The adapter does not fit the base model; the message names what and the keys."""


def _family(model_type: str) -> str:
    """Mixture-of-experts variants are the same family as far as which adapter belongs to which base."""
    return model_type.removesuffix("_moe")


def _named_model_type(hub_id: str) -> str | None:
    name = hub_id.rsplit("/", 1)[-1].lower().replace("_", "-")
    if _OTHER_ARCHITECTURES.search(name):
        return None
    for pattern, model_type in _NAMED_FAMILIES:
        if re.search(pattern, name):
            return model_type
    return None


def adapter_base_model_type(base_model_name_or_path: str | None) -> tuple[str | None, str]:
    """(model type the adapter was trained on, how that was found), or (None, why not), offline."""
    if not base_model_name_or_path:
        return None, "adapter_config.json names no base model"
    local = Path(base_model_name_or_path).expanduser()
    if (local / "config.json").is_file():
        return json.loads((local / "config.json").read_text()).get("model_type"), f"{local}/config.json"
    if not _HUB_ID.match(base_model_name_or_path) or local.exists():
        return None, f"{base_model_name_or_path} is neither a checkpoint directory nor a hub id"
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(base_model_name_or_path, "config.json")
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text()).get("model_type"), f"the cached {base_model_name_or_path}"
    named = _named_model_type(base_model_name_or_path)
    return named, f"the hub id {base_model_name_or_path}" if named else "an unknown hub id"


def check_adapter_dir(adapter_dir: str | Path, base_model_type: str) -> dict:
    """The adapter's adapter_config.json, after refusing a missing directory or config, and an adapter
    trained on another model type than `base_model_type` (see the module docstring)."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterMismatchError(f"adapter directory {adapter_dir} does not exist")
    config_path = adapter_dir / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterMismatchError(
            f"{adapter_dir} has no adapter_config.json: pass a peft adapter directory (what save_pretrained "
            "writes, e.g. the run's ckpt.output_dir or <ckpt.path>/global_step<N>_hf)"
        )
    config = json.loads(config_path.read_text())
    from openrlhf_lora_sync.config.weights_check import weights_problem

    unreadable = weights_problem(adapter_dir, "adapter_model")
    if unreadable:
        raise AdapterMismatchError(unreadable)
    trained_on, source = adapter_base_model_type(config.get("base_model_name_or_path"))
    if trained_on and _family(trained_on) != _family(base_model_type):
        raise AdapterMismatchError(
            f"adapter {adapter_dir} was trained on a {trained_on} model ({source}, its "
            f"base_model_name_or_path), but the base is {base_model_type}: pass the base it was trained on"
        )
    return config


def _named(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    return f"{shown} (and {len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else shown


def load_checked_adapter(base_model, adapter_dir: str | Path, *, is_trainable: bool = False):
    """`PeftModel.from_pretrained(base_model, adapter_dir)`, refused with AdapterMismatchError unless
    every adapter tensor lands in a LoRA module of the base with its shape and every LoRA module peft
    creates gets its tensors (peft's own load_adapter reports both)."""
    from peft import PeftConfig, PeftModel
    from peft.auto import MODEL_TYPE_TO_PEFT_MODEL_MAPPING

    adapter_dir = Path(adapter_dir)
    check_adapter_dir(adapter_dir, base_model.config.model_type)
    config = PeftConfig.from_pretrained(adapter_dir)
    config.inference_mode = not is_trainable
    peft_class = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)
    try:
        model = peft_class(base_model, config)
    except ValueError as error:  # peft: "Target modules {...} not found in the base model"
        raise AdapterMismatchError(f"adapter {adapter_dir} does not fit the base: {error}") from None
    try:
        result = model.load_adapter(adapter_dir, "default", is_trainable=is_trainable)
    except RuntimeError as error:
        mismatched = re.findall(r"size mismatch for (\S+?):", str(error))
        if not mismatched:
            raise
        raise AdapterMismatchError(
            f"adapter {adapter_dir} does not fit the base: {len(mismatched)} tensors of another shape than "
            f"the base's LoRA modules: {_named(mismatched)}; was it trained on another model size?"
        ) from None
    problems = []
    if result.unexpected_keys:
        problems.append(
            f"{len(result.unexpected_keys)} adapter tensors land in no module of the base: "
            f"{_named(result.unexpected_keys)}"
        )
    if result.missing_keys:
        problems.append(
            f"{len(result.missing_keys)} LoRA tensors of the base are not in the adapter: "
            f"{_named(result.missing_keys)}"
        )
    if problems:
        raise AdapterMismatchError(
            f"adapter {adapter_dir} does not fit the base ({'; '.join(problems)}); peft would load it as a "
            "partial or empty adapter. Pass the base it was trained on"
        )
    return model
