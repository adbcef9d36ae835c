"""Contract with the installed OpenRLHF: the symbols the sync patch replaces or calls; with the installed
vLLM: the internals the worker extension reaches past vLLM's public API for (layerwise reload bookkeeping,
the LoRA manager, the stateless process group); and, for every difference between supported releases
that sync/upstream_versions.py bridges, that the installed release has the form its version says.

Runs on each stack CI builds (the default one, the oldest one: versions.toml), so it checks each tested
release's form of what the patch relies on. An upgrade that renames, moves or re-signs one of these fails
here, before the patch breaks inside a Ray actor or an engine process. When this fails, re-read the new
upstream code and update the patch (a version difference: in upstream_versions.py).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect

import pytest
from openrlhf_lora_sync.base import pins

# symbol path -> its parameters (name, default or inspect.Parameter.empty) as the patch relies on them
EXPECTED_SIGNATURES = {
    "openrlhf.trainer.ray.ppo_actor:ActorPPOTrainer.broadcast_to_vllm": [("self", inspect.Parameter.empty)],
    "openrlhf.trainer.ray.vllm_worker_wrap:WorkerWrap.update_weight": [
        ("self", inspect.Parameter.empty),
        ("name", inspect.Parameter.empty),
        ("dtype", inspect.Parameter.empty),
        ("shape", inspect.Parameter.empty),
        ("empty_cache", False),
    ],
    "openrlhf.trainer.ray.vllm_worker_wrap:WorkerWrap.update_weight_cuda_ipc": [
        ("self", inspect.Parameter.empty),
        ("name", inspect.Parameter.empty),
        ("dtype", inspect.Parameter.empty),
        ("shape", inspect.Parameter.empty),
        ("ipc_handles", None),
        ("empty_cache", False),
    ],
    "openrlhf.trainer.ray.vllm_engine:create_vllm_engines": [
        ("num_engines", inspect.Parameter.empty),
        ("tensor_parallel_size", inspect.Parameter.empty),
        ("pretrain", inspect.Parameter.empty),
        ("seed", inspect.Parameter.empty),
        ("full_determinism", inspect.Parameter.empty),
        ("enable_prefix_caching", inspect.Parameter.empty),
        ("enforce_eager", inspect.Parameter.empty),
        ("max_model_len", inspect.Parameter.empty),
        ("shared_pg", None),
        ("gpu_memory_utilization", None),
        ("vllm_enable_sleep", False),
        ("logprobs_mode", None),
        ("agent_func_path", None),
        ("remote_rm_url", None),
        ("max_images_per_prompt", 0),
    ],
    "openrlhf.cli.train_ppo_ray:train": [("args", inspect.Parameter.empty)],
    # checkpoint.atomic_save_model passes a staging directory as output_dir; rank 0 alone writes files
    "openrlhf.utils.deepspeed:DeepspeedStrategy.save_model": [
        ("self", inspect.Parameter.empty),
        ("model", inspect.Parameter.empty),
        ("tokenizer", inspect.Parameter.empty),
        ("output_dir", inspect.Parameter.empty),
        ("kwargs", inspect.Parameter.empty),
    ],
}


def _resolve(path: str):
    module_name, _, qualname = path.partition(":")
    target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def test_installed_releases_are_ones_a_stack_pins():
    """This contract is what was checked on the pinned stacks; a release within range but pinned by no
    stack is run by users (preflight says so), not here."""
    status = pins.version_status(pins.installed_versions())
    assert set(status) == set(pins.CHECKED) and set(status.values()) == {"tested"}, status


def _source(path: str) -> str:
    return inspect.getsource(_resolve(path))


def _vllm_defers_by_predicate() -> bool:
    layers = importlib.import_module("vllm.model_executor.layers.attention")
    finalize = _source("vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_processing")
    return hasattr(layers, "is_deferred_attention_layer") and "is_deferred_attention_layer(layer)" in finalize


def _vllm_defers_attention_classes() -> bool:
    finalize = _source("vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_processing")
    return "isinstance(layer, (Attention, MLAAttention))" in finalize


def _vllm_lora_manager_uses(method: str):
    return lambda: f".{method}()" in _source("vllm.lora.worker_manager:WorkerLoRAManager")


def _openrlhf_flag(flag: str):
    return lambda: (
        f'"--algo.advantage.{flag}"'
        in inspect.getsource(importlib.import_module("openrlhf.cli.train_ppo_ray"))
    )


def _peft_has_no_match_error() -> bool:
    return importlib.util.find_spec("peft.utils.error") is not None and hasattr(
        importlib.import_module("peft.utils.error"), "NoMatchingPeftModuleError"
    )


def _peft_raises_value_error_for_no_match() -> bool:
    source = inspect.getsource(importlib.import_module("peft.tuners.tuners_utils"))
    return "not found in the base model" in source and "NoMatchingPeftModuleError" not in source


# Each difference upstream_versions.py bridges: (checked name, the release that changed it, "the installed
# package has the newer form", "... the older form"). Releases from that one on must have the newer form
# only, releases before it the older only (read from the released wheels when the shims were written).
FORMS = {
    # vLLM 0.28 added is_deferred_attention_layer; 0.27's reload defers (Attention, MLAAttention)
    "deferred attention layers": ("vllm", "0.28", _vllm_defers_by_predicate, _vllm_defers_attention_classes),
    # vLLM 0.29 renamed the LoRA manager's mapper variant get_unstacked_mapper -> get_rename_mapper
    "LoRA weights mapper": (
        "vllm",
        "0.29",
        _vllm_lora_manager_uses("get_rename_mapper"),
        _vllm_lora_manager_uses("get_unstacked_mapper"),
    ),
    # OpenRLHF 0.11.2 replaced the switch is_correction_enable with the level is_correction_level
    "IS-correction flag": (
        "openrlhf",
        "0.11.2",
        _openrlhf_flag("is_correction_level"),
        _openrlhf_flag("is_correction_enable"),
    ),
    # peft 0.21 raises NoMatchingPeftModuleError where 0.20 raised a plain ValueError
    "no-match error": ("peft", "0.21", _peft_has_no_match_error, _peft_raises_value_error_for_no_match),
}


@pytest.mark.parametrize("difference", sorted(FORMS))
def test_installed_release_has_the_form_its_version_says(difference):
    name, changed_in, has_newer_form, has_older_form = FORMS[difference]
    installed = pins.installed_versions()[name]
    newer = pins.in_range(installed, f">={changed_in}")
    assert (has_newer_form(), has_older_form()) == (newer, not newer), f"{name} {installed}: {difference}"


@pytest.mark.parametrize("path", sorted(EXPECTED_SIGNATURES))
def test_signature_unchanged(path):
    parameters = inspect.signature(_resolve(path)).parameters.values()
    assert [(p.name, p.default) for p in parameters] == EXPECTED_SIGNATURES[path]


def test_ppo_actor_methods_are_plain_functions():
    # The patch swaps these attributes on the class; a descriptor or Ray wrapper would need other handling.
    actor_trainer = _resolve("openrlhf.trainer.ray.ppo_actor:ActorPPOTrainer")
    assert inspect.isfunction(inspect.getattr_static(actor_trainer, "broadcast_to_vllm"))


def test_train_ppo_ray_builds_its_parser_under_main():
    # The launcher runs the module as __main__ (runpy) after patching, so the CLI flags stay upstream's.
    source = inspect.getsource(importlib.import_module("openrlhf.cli.train_ppo_ray"))
    main_blocks = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
    ]
    assert main_blocks, "train_ppo_ray no longer has an `if __name__ == '__main__'` block"
    body = ast.unparse(main_blocks[0])
    assert "argparse.ArgumentParser()" in body and "train(args)" in body


# vLLM internals -> the parameter names worker_extension.py / transport.py pass to them.
VLLM_PARAMETERS_USED = {
    "vllm.lora.lora_model:LoRAModel.from_lora_tensors": [
        "lora_model_id",
        "tensors",
        "peft_helper",
        "device",
        "dtype",
        "model_vocab_size",
        "weights_mapper",
        "skip_prefixes",
    ],
    "vllm.lora.peft_helper:PEFTHelper.validate_legal": ["lora_config"],
    "vllm.distributed.utils:stateless_init_torch_distributed_process_group": [
        "host",
        "port",
        "rank",
        "world_size",
        "backend",
    ],
    "vllm.model_executor.model_loader.reload:initialize_layerwise_reload": ["model"],
    "vllm.model_executor.model_loader.reload:finalize_layerwise_reload": [],
}


@pytest.mark.parametrize("path", sorted(VLLM_PARAMETERS_USED))
def test_vllm_internal_takes_what_the_worker_passes(path):
    parameters = inspect.signature(_resolve(path)).parameters
    assert set(VLLM_PARAMETERS_USED[path]) <= set(parameters)


def test_vllm_reload_and_lora_manager_internals():
    # ShmSlots reuse is safe only if every tensor the layerwise reload keeps is in `loaded_weights`
    # (worker_extension._reload_buffers_storage), and finish_weight_sync reads the load counters.
    info = _resolve("vllm.model_executor.model_loader.reload.types:LayerReloadingInfo")
    info_fields = {field.name for field in dataclasses.fields(info)}
    assert {"loaded_weights", "load_numel", "load_numel_total"} <= info_fields
    assert callable(_resolve("vllm.model_executor.model_loader.reload.layerwise:get_layerwise_info"))
    # install_lora_adapter registers the in-memory adapter in the worker manager's _adapter_manager.
    source = inspect.getsource(_resolve("vllm.lora.worker_manager:LRUCacheWorkerLoRAManager"))
    assert "self._adapter_manager = " in source


# Wrapped or replaced by reference_policy.install(), so checked on the upstream objects behind the patch:
# its group factory reads the first three parameters, the experience maker's wrapper the first five
# (BasePPOTrainer passes them by position).
UPSTREAM_SIGNATURES_UNDER_THE_PATCH = {
    "openrlhf.trainer.ray.launcher:RayActorGroup.__init__": [
        ("self", inspect.Parameter.empty),
        ("num_nodes", inspect.Parameter.empty),
        ("num_gpus_per_node", inspect.Parameter.empty),
        ("ray_actor_type", inspect.Parameter.empty),
        ("pg", None),
        ("num_gpus_per_actor", 1),
        ("duplicate_actors", 1),
        ("resources", None),
        ("num_resources_per_node", None),
    ],
    "openrlhf.trainer.ppo_utils.experience_maker:RemoteExperienceMaker.__init__": [
        ("self", inspect.Parameter.empty),
        ("actor_model_group", inspect.Parameter.empty),
        ("critic_model_group", inspect.Parameter.empty),
        ("reward_model_group", inspect.Parameter.empty),
        ("initial_model_group", inspect.Parameter.empty),
        ("kl_controller", inspect.Parameter.empty),
        ("strategy", inspect.Parameter.empty),
        ("tokenizer", inspect.Parameter.empty),
        ("kwargs", inspect.Parameter.empty),
    ],
}


@pytest.mark.parametrize("path", sorted(UPSTREAM_SIGNATURES_UNDER_THE_PATCH))
def test_signature_unchanged_under_the_patch(path):
    # The wrapped upstream function, not the wrapper (another test may have applied the patch already).
    module_name, _, qualname = path.partition(":")
    cls_name, _, attr = qualname.partition(".")
    cls = inspect.unwrap(getattr(importlib.import_module(module_name), cls_name))
    parameters = inspect.signature(inspect.unwrap(getattr(cls, attr))).parameters.values()
    assert [(p.name, p.default) for p in parameters] == UPSTREAM_SIGNATURES_UNDER_THE_PATCH[path]


def test_policy_actor_forward_takes_what_the_experience_maker_sends():
    # reference_forward runs upstream's PolicyModelActor.forward with the reference group's batch.
    actor = _resolve("openrlhf.trainer.ray.ppo_actor:PolicyModelActor").__ray_metadata__.modified_class
    names = list(inspect.signature(actor.forward).parameters)
    assert names[:4] == ["self", "sequences", "action_mask", "attention_mask"]
    assert "mm_train_inputs_list" in names


def test_train_ppo_ray_takes_its_groups_from_the_patched_modules():
    # reference_policy.install() replaces launcher.RayActorGroup and ppo_actor.PolicyModelActor, which
    # train_ppo_ray imports by name when the launcher runs it; it creates the reference group only with
    # the KL coefficient on, and the experience maker calls only forward and empty_cache on it.
    tree = ast.parse(inspect.getsource(importlib.import_module("openrlhf.cli.train_ppo_ray")))
    imported = {
        (node.module, alias.name)
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert {
        ("openrlhf.trainer.ray.launcher", "RayActorGroup"),
        ("openrlhf.trainer.ray.launcher", "ReferenceModelActor"),
        ("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor"),
    } <= imported
    train_source = inspect.getsource(_resolve("openrlhf.cli.train_ppo_ray:train"))
    assert "if args.algo.kl.init_coef > 0:\n        ref_model = RayActorGroup(" in train_source
    maker = _resolve("openrlhf.trainer.ppo_utils.experience_maker:RemoteExperienceMaker")
    uses = {line.strip() for line in inspect.getsource(maker).splitlines() if "initial_model_group" in line}
    assert uses == {
        "initial_model_group: RayActorGroup,",
        "self.initial_model_group = initial_model_group",
        "if self.initial_model_group is not None:",
        "self.initial_model_group,",  # the group argument of _dispatch_forward
        "if (self.initial_model_group is not None) and (not args.algo.kl.use_loss):",
    }, uses
    dispatch = inspect.getsource(maker._dispatch_forward)
    assert 'method_name="forward"' in dispatch and 'method_name="empty_cache"' in dispatch
