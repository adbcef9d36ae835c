"""scripts/memory_budget.py: parameter counts against real transformers models, LoRA counts against peft,
the phase arithmetic, the mapping of recipe flags, and the answer for the user's Qwen3.5-27B on 4x4090.

Models are built on the meta device (nothing allocated), so real sizes (27B included) are compared exactly
with `sum(p.numel())`. Not covered: measured GPU memory (no GPU here); the module docstring states what
the estimates assume.
"""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from scripts import memory_budget as mb

GIB = mb.GIB
TINY_TEXT = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3}
TINY_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY_LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 3,
}
TINY_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64}

# config.json dicts covering each family, both hub layouts of Qwen2.5-VL, tied and untied embeddings,
# attention biases, custom layer_types and deepstack mergers, plus every reference config at full size.
CONFIG_CASES = {
    "qwen2_5_vl flat (hub layout), tied": {
        "model_type": "qwen2_5_vl",
        "tie_word_embeddings": True,
        **TINY_TEXT,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vision_config": {**TINY_VISION, "fullatt_block_indexes": [1]},
    },
    "qwen2_5_vl nested": {
        "model_type": "qwen2_5_vl",
        "text_config": {**TINY_TEXT, "num_attention_heads": 2, "num_key_value_heads": 1},
        "vision_config": {**TINY_VISION, "spatial_merge_size": 1, "patch_size": 8},
    },
    "qwen3_vl deepstack": {
        "model_type": "qwen3_vl",
        "text_config": {**TINY_TEXT, **TINY_HEADS},
        "vision_config": {**TINY_VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]},
    },
    "qwen3_vl no deepstack, attention bias": {
        "model_type": "qwen3_vl",
        "text_config": {**TINY_TEXT, **TINY_HEADS, "attention_bias": True},
        "vision_config": {**TINY_VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": []},
    },
    "qwen3_5 default interval": {
        "model_type": "qwen3_5",
        "text_config": {**TINY_TEXT, "num_hidden_layers": 8, **TINY_HEADS, **TINY_LINEAR},
        "vision_config": {**TINY_VISION, "num_position_embeddings": 16},
    },
    "qwen3_5 explicit layer_types, tied": {
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": {
            **TINY_TEXT,
            **TINY_HEADS,
            **TINY_LINEAR,
            "layer_types": ["full_attention", "linear_attention", "full_attention"],
        },
        "vision_config": {**TINY_VISION, "num_position_embeddings": 16},
    },
    "qwen3_5_text (text only)": {"model_type": "qwen3_5_text", **TINY_TEXT, **TINY_HEADS, **TINY_LINEAR},
    "qwen3 text only, bias": {"model_type": "qwen3", **TINY_TEXT, **TINY_HEADS, "attention_bias": True},
    "qwen3 text only, tied": {"model_type": "qwen3", **TINY_TEXT, **TINY_HEADS, "tie_word_embeddings": True},
    **{name: config for name, config in mb.REFERENCE_CONFIGS.items()},
}


def build_on_meta(config: dict):
    kwargs = dict(config)
    model_type = kwargs.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **kwargs)
    auto_cls = (
        AutoModelForCausalLM if model_type in ("qwen3", "qwen3_5_text") else AutoModelForImageTextToText
    )
    with torch.device("meta"):
        return auto_cls.from_config(hf_config)


def part_of(name: str) -> str:
    if name.startswith("lm_head"):
        return "lm_head"
    if name.startswith("model.visual."):
        return "merger" if "merger" in name else "vision"
    return "embed" if "embed_tokens" in name else "layers"


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_parameter_counts_by_part_equal_transformers(case):
    config = CONFIG_CASES[case]
    model = build_on_meta(config)
    real = dict.fromkeys(mb.PARTS, 0)
    for name, parameter in model.named_parameters():
        real[part_of(name)] += parameter.numel()
    assert mb.model_spec(config).parameters_by_part() == real
    assert mb.model_spec(config).total_parameters == sum(p.numel() for p in model.parameters())


def test_every_parameter_of_a_real_model_has_a_module_in_the_inventory():
    config = CONFIG_CASES["qwen3_vl deepstack"]
    inventory = {name for group in mb.model_spec(config).modules for name in group.names()}
    for name, _ in build_on_meta(config).named_parameters():
        module = name.rsplit(".", 1)[0]
        assert module in inventory, name


def test_reference_sizes_are_the_published_ones():
    total = {name: mb.model_spec(config).total_parameters for name, config in mb.REFERENCE_CONFIGS.items()}
    assert total["Qwen/Qwen2.5-VL-7B-Instruct"] == 8_292_166_656
    assert total["Qwen/Qwen3-VL-8B-Instruct"] == 8_767_123_696
    assert total["Qwen/Qwen2.5-VL-3B-Instruct"] == 3_754_622_976
    assert 27.0e9 < total["Qwen/Qwen3.5-27B"] < 27.6e9


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3"])
def test_defaults_are_transformers_defaults(family):
    config = AutoConfig.for_model(family)
    text = config.text_config if hasattr(config, "text_config") else config
    for key, value in mb.TEXT_DEFAULTS[family].items():
        if key == "full_attention_interval":  # consumed into layer_types, not kept as an attribute
            expected = ["full_attention" if (i + 1) % value == 0 else "linear_attention" for i in range(32)]
            assert text.layer_types == expected
        else:
            assert getattr(text, key) == value, key
    if family in mb.VISION_DEFAULTS:
        for key, value in mb.VISION_DEFAULTS[family].items():
            actual = getattr(config.vision_config, key)
            assert (list(actual) if isinstance(actual, tuple) else actual) == value, key


LORA_CASES = [
    ("qwen3_5 default interval", "all-linear"),
    ("qwen3_5 default interval", ["in_proj_qkv", "out_proj", "q_proj"]),
    ("qwen2_5_vl flat (hub layout), tied", ["q_proj", "v_proj"]),
    ("qwen2_5_vl nested", ["gate_proj"]),  # also the vision tower's gated MLP
    ("qwen2_5_vl nested", "all-linear"),
    ("qwen3_vl deepstack", mb.LANGUAGE_ONLY_LORA),
    ("qwen3_vl deepstack", ["linear_fc1"]),  # vision MLPs and every merger
    ("qwen3 text only, tied", "all-linear"),
    ("Qwen/Qwen3.5-27B", mb.LANGUAGE_ONLY_LORA),
]


@pytest.mark.parametrize(("case", "targets"), LORA_CASES, ids=[f"{c}-{t}" for c, t in LORA_CASES])
def test_lora_parameter_counts_equal_peft(case, targets):
    from peft import LoraConfig, get_peft_model

    config = CONFIG_CASES[case]
    model = build_on_meta(config)
    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert mb.lora_parameters(
        mb.model_spec(config), 8, tuple(targets) if isinstance(targets, list) else targets
    ) == (trainable)


def test_language_only_lora_leaves_the_vision_tower_alone():
    spec = mb.model_spec(mb.REFERENCE_CONFIGS["Qwen/Qwen3.5-27B"])
    parts = {group.part for group, _ in mb.lora_modules(spec, mb.LANGUAGE_ONLY_LORA)}
    assert parts == {"layers"}
    assert {group.part for group, _ in mb.lora_modules(spec, "all-linear")} == {"vision", "merger", "layers"}


@pytest.fixture(scope="module")
def spec_27b():
    return mb.model_spec(mb.REFERENCE_CONFIGS["Qwen/Qwen3.5-27B"])


LEAN_AT_08 = replace(mb.LEAN, gpu_memory_utilization=0.8)


def part(budget, phase, name):
    return budget.phase(phase).parts.get(name, 0.0)


def test_kv_cache_counts_full_attention_layers_and_linear_state(spec_27b):
    per_token, state = mb._vllm_kv(spec_27b, LEAN_AT_08)
    # 16 gated-attention layers, 4 KV heads over TP4 = 1 each, head_dim 256, K and V, bf16.
    assert per_token == 16 * 2 * 1 * 256 * 2
    # 48 Gated DeltaNet layers: 48/4 value heads x 128 x 128 fp32 state + the conv state.
    assert state == 48 * (12 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) / 4 * 3 * 2)
    qwen25 = mb.model_spec(mb.REFERENCE_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"])
    assert mb._vllm_kv(qwen25, LEAN_AT_08) == (28 * 2 * 1 * 128 * 2, 0)


@pytest.mark.parametrize(
    ("change", "check"),
    [
        (
            {"param_offload": True},
            lambda base, new, p: (
                part(new, "sync", "base shard") == 0
                and part(base, "sync", "base shard") == pytest.approx(2 * p / 4)
                and part(new, "rollout", "LoRA weights") == 0 < part(base, "rollout", "LoRA weights")
                # the optimizer goes to the host with the parameters (offload.py)
                and part(new, "train", "LoRA optimizer") == 0 < part(base, "train", "LoRA optimizer")
                and new.host_bytes - base.host_bytes == pytest.approx(2 * p)
                and new.host_parts["trainer base (offload)"] == pytest.approx(2 * p)
            ),
        ),
        (
            {"reference": "gpu"},
            lambda base, new, p: all(
                new.phase(n).total - base.phase(n).total == pytest.approx(2 * p / 4 + mb.PROCESS_OVERHEAD)
                for n in ("rollout", "train", "sync")
            ),
        ),
        (
            # the policy with its adapters disabled: nothing loaded, no process (reference_policy.py)
            {"reference": "base"},
            lambda base, new, p: (
                [ph.parts for ph in new.phases] == [ph.parts for ph in base.phases]
                and new.host_parts == base.host_parts
            ),
        ),
        (
            {"vllm_sleep_level": 2},
            lambda base, new, p: (
                base.host_parts["vLLM weights (sleep level 1)"] == pytest.approx(2 * p)
                and "vLLM weights (sleep level 1)" not in new.host_parts
                and new.phases == base.phases
            ),
        ),
        (
            {"vllm_sleep_level": 0},
            lambda base, new, p: (
                part(new, "train", "vLLM (asleep)") == pytest.approx(0.8 * 24 * GIB)
                and part(new, "sync", "vLLM budget") == pytest.approx(0.8 * 24 * GIB)
            ),
        ),
        (
            {"transport": "shm"},
            lambda base, new, p: part(new, "sync", "bucket") == 2 * part(base, "sync", "bucket"),
        ),
        ({"zero_stage": 2}, lambda base, new, p: part(new, "rollout", "base") == pytest.approx(2 * p)),
        (
            {"gradient_checkpointing": False},
            lambda base, new, p: part(new, "train", "activations") > 5 * part(base, "train", "activations"),
        ),
        (
            {"base_4bit": True},
            lambda base, new, p: (
                0.25 < part(new, "sync", "base shard") / part(base, "sync", "base shard") < 0.35
                and part(new, "sync", "vLLM weights") == part(base, "sync", "vLLM weights")
            ),
        ),
        (
            {"ds_sleep": False},
            lambda base, new, p: (
                part(new, "sync", "LoRA optimizer") == pytest.approx(12 * base.lora_parameters / 4)
            ),
        ),
        ({"bucket_mb": 4096}, lambda base, new, p: part(new, "sync_delta", "bucket") == 4096 * mb.MIB),
    ],
    ids=[
        "param offload",
        "reference",
        "reference from the base",
        "sleep level 2",
        "no sleep",
        "shm",
        "zero2",
        "no checkpointing",
        "4bit",
        "no ds sleep",
        "bucket",
    ],
)
def test_one_knob_moves_the_right_component(spec_27b, change, check):
    base = mb.estimate(spec_27b, LEAN_AT_08)
    new = mb.estimate(spec_27b, replace(LEAN_AT_08, **change))
    assert check(base, new, spec_27b.total_parameters)


def test_sync_holds_both_copies_of_the_weights_plus_transients(spec_27b):
    budget = mb.estimate(spec_27b, LEAN_AT_08)
    sync = budget.phase("sync").parts
    p = spec_27b.total_parameters
    assert sync["vLLM weights"] == pytest.approx(2 * p / 4)
    assert sync["base shard"] == pytest.approx(2 * p / 4)
    # A full sync gathers lm_head (1.27 B parameters) in bf16 and ships it as one bucket.
    assert sync["gathered/merged"] == sync["bucket"] == pytest.approx(2 * 248320 * 5120)
    # Later (delta) syncs merge the largest LoRA module: gate_proj or up_proj, 10 bytes a parameter.
    delta = budget.phase("sync_delta").parts
    assert delta["gathered/merged"] == pytest.approx(10 * 5120 * 17408)
    assert delta["bucket"] == pytest.approx(2 * 2 * 5120 * 17408)  # the fused gate_up group: never split
    wide = mb.estimate(spec_27b, replace(LEAN_AT_08, bucket_mb=512)).phase("sync_delta").parts
    assert wide["bucket"] == 512 * mb.MIB  # the bucket size, over the fused gate_up group's 340 MiB


def test_separate_vllm_gpus_have_their_own_role():
    spec = mb.model_spec(mb.REFERENCE_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"])
    settings = replace(LEAN_AT_08, colocate=False, vllm_tp=2, vllm_engines=1, vllm_sleep_level=0)
    budget = mb.estimate(spec, settings)
    assert settings.trainer_gpus == 2
    roles = {(p.name, p.role) for p in budget.phases}
    assert ("rollout", "vllm") in roles and ("train", "trainer") in roles
    trainer_sync = next(p for p in budget.phases if p.name == "sync" and p.role == "trainer")
    assert trainer_sync.parts["base shard"] == pytest.approx(2 * spec.total_parameters / 2)


def test_openrlhf_defaults_are_those_of_its_parser():
    import openrlhf.cli.train_ppo_ray as train_ppo_ray

    defaults = {}
    for node in ast.walk(ast.parse(Path(train_ppo_ray.__file__).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
            flag = getattr(node.args[0], "value", None)
            keywords = {kw.arg: kw.value for kw in node.keywords}
            if isinstance(flag, str) and flag[2:] in mb.OPENRLHF_DEFAULTS and "default" in keywords:
                defaults[flag[2:]] = ast.literal_eval(keywords["default"])
    for flag, value in mb.OPENRLHF_DEFAULTS.items():
        assert defaults[flag] == value, flag


def test_the_users_flags_map_to_the_users_setting():
    upstream = {**mb.USER_27B_FLAGS, "sync.reference_from_base": False}
    assert mb.settings_from_flags(upstream) == mb.USER_27B
    # Through this repo's patch (its default): the KL reference is the policy with its adapters disabled.
    assert mb.settings_from_flags(mb.USER_27B_FLAGS) == replace(mb.USER_27B, reference="base")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"algo.kl.init_coef": 0}, {"reference": "none"}),
        ({"ref.offload": True}, {"reference": "cpu"}),
        ({"vllm.enable_sleep": True, "sync.vllm_sleep_level": 2}, {"vllm_sleep_level": 2}),
        ({"vllm.enable_sleep": False, "sync.vllm_sleep_level": 2}, {"vllm_sleep_level": 0}),
        ({"sync.bucket_mb": 128}, {"bucket_mb": 128}),
        ({"trainer.offload_params": True}, {"param_offload": True}),
        ({"ds.lora.rank": 8}, {"reference": "base"}),
        ({"ds.lora.rank": 8, "sync.reference_from_base": False}, {"reference": "gpu"}),
        ({"ds.lora.rank": 8, "sync.reference_from_base": False, "ref.offload": True}, {"reference": "cpu"}),
        ({"ds.lora.rank": 8, "algo.kl.init_coef": 0}, {"reference": "none"}),
        ({"ds.lora.target_modules": ["q_proj", "v_proj"]}, {"lora_targets": ("q_proj", "v_proj")}),
        ({"ds.lora.target_modules": ["all-linear"]}, {"lora_targets": "all-linear"}),
        ({"actor.num_gpus_per_node": 2, "vllm.tensor_parallel_size": 2}, {"gpus": 4, "vllm_engines": 1}),
    ],
)
def test_flag_mapping(flags, expected):
    settings = mb.settings_from_flags(flags)
    assert {key: getattr(settings, key) for key in expected} == expected


def test_the_users_27b_does_not_fit_at_sync_and_param_offload_makes_it_fit(spec_27b):
    as_given = mb.estimate(spec_27b, mb.USER_27B)
    assert not as_given.fits("sync")
    lean = mb.estimate(spec_27b, replace(LEAN_AT_08, gpu_memory_utilization=0.3))
    # Even without the reference and with a small vLLM budget, both bf16 copies exceed a 24 GiB card.
    assert lean.phase("sync").total > lean.usable
    assert 2 * 2 * spec_27b.total_parameters / 4 > 24 * GIB
    changes, fitting = mb.find_fitting(spec_27b, mb.USER_27B)
    assert any("parameter offload" in change for change in changes)
    assert mb.estimate(spec_27b, fitting).fits()


def test_the_table_answers_which_qwen35_fits_comfortably():
    budgets = {b.model.split(",")[0]: b for b in mb.table_rows()}
    nine = budgets["9B"]
    assert nine.fits() and nine.kv_sequences > 64
    # Comfortably: training and the full sync leave at least 5 GiB of the 24.
    assert all(nine.phase(name).total < 19 * GIB for name in ("train", "sync"))
    assert not budgets["27B"].fits("sync")
    assert budgets["27B + trainer base offload"].fits()


def test_host_alternatives_need_less_host_ram(spec_27b):
    offloaded = replace(LEAN_AT_08, param_offload=True, reference="cpu")
    budget = mb.estimate(spec_27b, offloaded)
    alternatives = dict(mb.host_alternatives(spec_27b, offloaded))
    assert set(alternatives) == {
        "sync.vllm_sleep_level: 2 (vLLM discards its weights while asleep; every sync is then full)",
        "trainer.offload_params: false (the trainer's base back on the GPUs)",
        "sync.reference_from_base: true (no reference model)",
    }
    p = spec_27b.total_parameters
    assert all(budget.host_bytes - after.host_bytes >= 2 * p for after in alternatives.values())
    # Without offload the trainer's base shard is back on the GPUs, and the 27B no longer fits.
    assert not alternatives["trainer.offload_params: false (the trainer's base back on the GPUs)"].fits()
    lean = replace(offloaded, vllm_sleep_level=2, param_offload=False, reference="none")
    assert mb.host_alternatives(spec_27b, lean) == []


def test_cli_table_and_model_dir(tmp_path, capsys):
    assert mb.main(["--table"]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == len(mb.TABLE_ROWS) + 1  # the header and one row per setting
    (tmp_path / "config.json").write_text(json.dumps(CONFIG_CASES["qwen3_5 default interval"]))
    flags = ["actor.num_gpus_per_node=1", "ds.lora.rank=8", "vllm.gpu_memory_utilization=0.9"]
    args = ["--model", str(tmp_path), "--json", *(f"--set={flag}" for flag in flags)]
    assert mb.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["lora_parameters"] > 0
    assert mb.main(["--model", "Qwen/Qwen3.5-27B", "--set", "actor.num_gpus_per_node=4"]) == 1
