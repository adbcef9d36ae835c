"""Sync planning (plan.py) as pure logic, and the buckets a sync cuts from a plan: no engine.

Covers: the first plan is full (every unit, trained or not), later ones delta (only what training changes:
LoRA layers and `modules_to_save` copies, in model order) until the weights are lost or a full sync is
forced; fused-group expansion from a packed_modules_mapping (q/k/v, gate/up, Qwen3.5's in_proj pairs;
members the model lacks are not invented); empty plans; and, through sync_weights with a recording
transport and no engine, that a delta's fused group never spans two buckets however small they are.
Does not cover: the engine's side (tests/sync/test_sync.py) or merging (tests/sync/test_sync.py,
tests/sync/test_zero3_sync.py).
"""

from __future__ import annotations

import torch
from openrlhf_lora_sync.sync.merge import SyncUnit
from openrlhf_lora_sync.sync.plan import DEFAULT_PACKED_MODULES, SyncState, delta_plan, full_plan

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _unit(name: str, lora: bool = False, trained_copy: bool = False) -> SyncUnit:
    params = {"weight": torch.nn.Parameter(torch.zeros(1))}
    # The plan reads only whether a unit carries LoRA; any module stands for the peft layer.
    return SyncUnit(name, params, lora_layer=torch.nn.Identity() if lora else None, trained_copy=trained_copy)


def _layer_units(layer: int, lora_on: tuple[str, ...]) -> list[SyncUnit]:
    prefix = f"model.layers.{layer}"
    units = [_unit(f"{prefix}.self_attn.{leaf}", leaf in lora_on) for leaf in ATTENTION]
    units += [_unit(f"{prefix}.mlp.{leaf}", leaf in lora_on) for leaf in MLP]
    return [_unit(f"{prefix}.input_layernorm"), *units]


def _model_units(lora_on: tuple[str, ...]) -> list[SyncUnit]:
    return [
        _unit("model.embed_tokens"),
        *_layer_units(0, lora_on),
        *_layer_units(1, lora_on),
        _unit("lm_head"),
    ]


def test_first_plan_is_full_then_delta_until_weights_are_lost_or_full_is_forced():
    units, state = _model_units(("q_proj",)), SyncState()
    first = state.next_plan(units, DEFAULT_PACKED_MODULES)
    assert (first.mode, first.reason, first.units) == ("full", "first sync", units)
    state.synced()
    assert state.next_plan(units, DEFAULT_PACKED_MODULES).mode == "delta"
    forced = state.next_plan(units, DEFAULT_PACKED_MODULES, force_full=True)
    assert (forced.mode, forced.reason, forced.module_names) == (
        "full",
        "forced",
        [u.module_name for u in units],
    )
    assert state.next_plan(units, DEFAULT_PACKED_MODULES).mode == "delta"  # forcing one leaves the state
    state.weights_lost("engine woke from sleep level 2")
    lost = state.next_plan(units, DEFAULT_PACKED_MODULES)
    assert (lost.mode, lost.reason) == ("full", "engine woke from sleep level 2")
    state.synced()
    assert state.next_plan(units, DEFAULT_PACKED_MODULES).mode == "delta"


def test_delta_expands_lora_to_its_whole_fused_groups_and_nothing_else():
    plan = delta_plan(_model_units(("q_proj", "v_proj", "up_proj")), DEFAULT_PACKED_MODULES)
    expected = [
        f"model.layers.{layer}.{leaf}"
        for layer in (0, 1)
        for leaf in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    ]
    assert plan.mode == "delta" and plan.module_names == expected  # model order, o/down/norms left out


def test_delta_expands_qwen3_5_linear_attention_pairs():
    prefix = "model.language_model.layers.0.linear_attn"
    leaves = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    units = [_unit(f"{prefix}.{leaf}", lora=leaf in ("in_proj_qkv", "in_proj_b")) for leaf in leaves]
    plan = delta_plan(units, DEFAULT_PACKED_MODULES)
    assert plan.module_names == [f"{prefix}.{leaf}" for leaf in leaves[:4]]


def test_delta_takes_modules_to_save_copies_and_never_invents_missing_members():
    # A model with q and v but no k module: the fused group names k, the plan cannot send what is not there.
    units = [_unit("model.layers.0.self_attn.q_proj", lora=True), _unit("model.layers.0.self_attn.v_proj")]
    units.append(_unit("lm_head", trained_copy=True))
    plan = delta_plan(units, DEFAULT_PACKED_MODULES)
    assert plan.module_names == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "lm_head",
    ]


def test_the_engine_mapping_decides_what_is_fused():
    units = _layer_units(0, ("q_proj",))
    assert delta_plan(units, {}).module_names == ["model.layers.0.self_attn.q_proj"]


def test_empty_plans():
    assert (
        delta_plan(_model_units(()), DEFAULT_PACKED_MODULES).units == []
    )  # nothing trained: nothing to send
    assert delta_plan([], DEFAULT_PACKED_MODULES).units == []
    assert full_plan([], "first sync").units == []


def test_a_delta_sync_never_splits_a_fused_group_across_buckets():
    """sync_weights on a tiny peft policy, buckets smaller than any tensor, recorded instead of sent."""
    from openrlhf_lora_sync.sync.sync import sync_weights
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
    )
    torch.manual_seed(0)
    policy = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj", "up_proj"]))
    buckets: list[list[str]] = []

    def record(rpc, named):
        buckets.append([name for name, _ in named])
        return sum(t.numel() * t.element_size() for _, t in named), None

    state = SyncState()
    state.synced()
    stats = sync_weights(
        policy, None, state, dtype=torch.float32, bucket_bytes=1, send=False, transport=record
    )
    fused = {"self_attn": ("q", "k", "v"), "mlp": ("gate", "up")}
    expected = {
        f"model.layers.{layer}.{block}.{leaf}_proj.weight"
        for layer in (0, 1)
        for block, leaves in fused.items()
        for leaf in leaves
    }
    assert stats.mode == "delta" and {name for bucket in buckets for name in bucket} == expected
    # Each bucket is one whole fused group, although every tensor alone is over the limit.
    assert sorted(sorted(bucket) for bucket in buckets) == sorted(
        sorted(f"model.layers.{layer}.{block}.{leaf}_proj.weight" for leaf in leaves)
        for layer in (0, 1)
        for block, leaves in fused.items()
    )
