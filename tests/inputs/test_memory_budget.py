"""memory_budget.py: its inventory against real transformers models (parameter counts by part), LoRA counts
against peft, vLLM's stacking, the phase arithmetic, settings from the one recipe path (recipe.load_run),
the CLI (--recipe, --model, --set, --table) and the answer for the user's Qwen3.5-27B on 4x4090.

Models are built on the meta device (nothing allocated), so real sizes (27B included) are compared exactly
with `sum(p.numel())`. Not covered: measured GPU memory (no GPU here); the module docstring states what
the estimates assume.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from openrlhf_lora_sync.config import memory_budget as mb
from openrlhf_lora_sync.config import memory_report as report
from openrlhf_lora_sync.config import model_inventory as mi
from openrlhf_lora_sync.config import recipe
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

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
    **{name: config for name, config in mi.REFERENCE_CONFIGS.items()},
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
    real = dict.fromkeys(mi.PARTS, 0)
    for name, parameter in model.named_parameters():
        real[part_of(name)] += parameter.numel()
    assert mi.model_spec(config).parameters_by_part() == real
    assert mi.model_spec(config).total_parameters == sum(p.numel() for p in model.parameters())


def test_every_parameter_of_a_real_model_has_a_module_in_the_inventory():
    config = CONFIG_CASES["qwen3_vl deepstack"]
    inventory = {module.name for module in mi.model_spec(config).modules}
    for name, _ in build_on_meta(config).named_parameters():
        module = name.rsplit(".", 1)[0]
        assert module in inventory, name


def test_inventory_knows_layer_types_stacking_and_tied_embeddings():
    spec = mi.model_spec(CONFIG_CASES["qwen3_5 explicit layer_types, tied"])
    kinds = {(m.name.rpartition(".")[2], m.layer, m.layer_type) for m in spec.modules if m.linear}
    assert ("q_proj", 0, "full_attention") in kinds and ("q_proj", 2, "full_attention") in kinds
    assert ("in_proj_qkv", 1, "linear_attention") in kinds
    assert not any(name == "q_proj" for name, layer, _ in kinds if layer == 1)  # layer 1: linear attention
    assert (spec.full_attention_layers, spec.linear_attention_layers) == (2, 1)
    stacked = {m.name.rpartition(".")[2]: m.stacked for m in spec.modules if m.stacked}
    assert stacked == {key: value for key, value in mi.VLLM_STACKED.items() if key in stacked}
    assert set(stacked) == set(mi.VLLM_STACKED)  # every stacked family is there in Qwen3.5
    # Tied: lm_head holds nothing of its own; the shared weight is counted once, under embed.
    assert spec.parameters_by_part()["lm_head"] == 0 and spec.parameters_by_part()["embed"] == 320 * 64


def test_reference_sizes_are_the_published_ones():
    total = {name: mi.model_spec(config).total_parameters for name, config in mi.REFERENCE_CONFIGS.items()}
    assert total["Qwen/Qwen2.5-VL-7B-Instruct"] == 8_292_166_656
    assert total["Qwen/Qwen3-VL-8B-Instruct"] == 8_767_123_696
    assert total["Qwen/Qwen2.5-VL-3B-Instruct"] == 3_754_622_976
    assert 27.0e9 < total["Qwen/Qwen3.5-27B"] < 27.6e9


LORA_CASES = [
    ("qwen3_5 default interval", "all-linear"),
    ("qwen3_5 default interval", ["in_proj_qkv", "out_proj", "q_proj"]),
    ("qwen2_5_vl flat (hub layout), tied", ["q_proj", "v_proj"]),
    ("qwen2_5_vl nested", ["gate_proj"]),  # also the vision tower's gated MLP
    ("qwen2_5_vl nested", "all-linear"),
    ("qwen3_vl deepstack", report.LANGUAGE_ONLY_LORA),
    ("qwen3_vl deepstack", ["linear_fc1"]),  # vision MLPs and every merger
    ("qwen3 text only, tied", "all-linear"),
    ("Qwen/Qwen3.5-27B", report.LANGUAGE_ONLY_LORA),
]


@pytest.mark.parametrize(("case", "targets"), LORA_CASES, ids=[f"{c}-{t}" for c, t in LORA_CASES])
def test_lora_parameter_counts_equal_peft(case, targets):
    from peft import LoraConfig, get_peft_model

    config = CONFIG_CASES[case]
    model = build_on_meta(config)
    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert mi.lora_parameters(
        mi.model_spec(config), 8, tuple(targets) if isinstance(targets, list) else targets
    ) == (trainable)
    if isinstance(targets, list):  # the modules peft wrapped, by name: those the sync merges
        wrapped = {module.name for module in mi.lora_modules(mi.model_spec(config), 8, tuple(targets))}
        assert wrapped == {
            name.removeprefix("base_model.model.").rsplit(".lora_A", 1)[0]
            for name, _ in peft_model.named_parameters()
            if ".lora_A." in name
        }


def test_language_only_lora_leaves_the_vision_tower_alone():
    spec = mi.model_spec(mi.REFERENCE_CONFIGS["Qwen/Qwen3.5-27B"])
    parts = {module.part for module in mi.lora_modules(spec, 64, report.LANGUAGE_ONLY_LORA)}
    assert parts == {"layers"}
    assert {module.part for module in mi.lora_modules(spec, 64, "all-linear")} == {
        "vision",
        "merger",
        "layers",
    }


@pytest.fixture(scope="module")
def spec_27b():
    return mi.model_spec(mi.REFERENCE_CONFIGS["Qwen/Qwen3.5-27B"])


LEAN_AT_08 = replace(report.LEAN, gpu_memory_utilization=0.8)


def part(budget, phase, name):
    return budget.phase(phase).parts.get(name, 0.0)


def test_kv_cache_counts_full_attention_layers_and_linear_state(spec_27b):
    per_token, state = mb._vllm_kv(spec_27b, LEAN_AT_08)
    # 16 gated-attention layers, 4 KV heads over TP4 = 1 each, head_dim 256, K and V, bf16.
    assert per_token == 16 * 2 * 1 * 256 * 2
    # 48 Gated DeltaNet layers: 48/4 value heads x 128 x 128 fp32 state + the conv state.
    assert state == 48 * (12 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) / 4 * 3 * 2)
    qwen25 = mi.model_spec(mi.REFERENCE_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"])
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
            # auto is shm on a shared GPU: the engine receives a copy; CUDA IPC maps the bucket in place
            {"transport": "cuda_ipc"},
            lambda base, new, p: 2 * part(new, "sync", "bucket") == part(base, "sync", "bucket"),
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
        # auto is shm here: the trainer's bucket and the engine's copy of it
        ({"bucket_mb": 4096}, lambda base, new, p: part(new, "sync_delta", "bucket") == 2 * 4096 * mb.MIB),
    ],
    ids=[
        "param offload",
        "reference",
        "reference from the base",
        "sleep level 2",
        "no sleep",
        "cuda_ipc",
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
    budget = mb.estimate(spec_27b, replace(LEAN_AT_08, transport="cuda_ipc"))
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
    wide = mb.estimate(spec_27b, replace(LEAN_AT_08, transport="cuda_ipc", bucket_mb=512))
    wide = wide.phase("sync_delta").parts
    assert wide["bucket"] == 512 * mb.MIB  # the bucket size, over the fused gate_up group's 340 MiB


def test_separate_vllm_gpus_have_their_own_role():
    spec = mi.model_spec(mi.REFERENCE_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"])
    settings = replace(LEAN_AT_08, colocate=False, vllm_tp=2, vllm_engines=1, vllm_sleep_level=0)
    budget = mb.estimate(spec, settings)
    assert settings.trainer_gpus == 2
    roles = {(p.name, p.role) for p in budget.phases}
    assert ("rollout", "vllm") in roles and ("train", "trainer") in roles
    trainer_sync = next(p for p in budget.phases if p.name == "sync" and p.role == "trainer")
    assert trainer_sync.parts["base shard"] == pytest.approx(2 * spec.total_parameters / 2)


def test_transport_auto_resolves_as_the_patch_does(spec_27b):
    def bucket(**change):
        budget = mb.estimate(spec_27b, replace(LEAN_AT_08, **change))
        return max(p.parts["bucket"] for p in budget.phases if p.name == "sync" and p.role != "vllm")

    mapped = bucket(transport="cuda_ipc")
    assert bucket() == bucket(transport="shm") == 2 * mapped  # auto on a shared GPU: /dev/shm, copied
    assert bucket(transport="broadcast") == 2 * mapped
    separate = {"colocate": False, "gpus": 8}
    # auto on separate GPUs is broadcast: each side holds its own copy, none twice
    assert bucket(**separate) == bucket(transport="broadcast", **separate) == mapped


def test_stacked_groups_are_vllms_packed_modules():
    from vllm.model_executor.models import qwen2_5_vl, qwen3_5, qwen3_vl

    classes = (
        qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
        qwen3_vl.Qwen3VLForConditionalGeneration,
        qwen3_5.Qwen3_5ForConditionalGeneration,
    )
    stacked = {
        part: fused
        for cls in classes
        for fused, parts in cls.packed_modules_mapping.items()
        for part in parts
        if part != fused  # "qkv": ["qkv"], the vision tower's own fused tensor
    }
    assert stacked == mi.VLLM_STACKED


# What OpenRLHF's own checks need besides the user's flags: GRPO groups, a reward, the colocated
# reference on the actor's GPUs (upstream train() asserts it).
RUN_NEEDS = [
    "rollout.n_samples_per_prompt=8",
    "reward.remote_url=rewards/math_answer.py",
    "ref.num_gpus_per_node=4",
]


def run_of(flags: dict, *overrides: str):
    """OpenRLHF's defaults (no recipe) with these flags, through the one recipe path."""
    return recipe.load_run(None, [*RUN_NEEDS, *(f"{k}={v}" for k, v in flags.items()), *overrides], {})


def test_the_users_flags_map_to_the_users_setting():
    upstream = run_of(report.USER_27B_FLAGS, "sync.reference_from_base=false")
    assert mb.shape_from_run(upstream) == report.USER_27B
    # Through this repo's patch (its default): the KL reference is the policy with its adapters disabled.
    assert mb.shape_from_run(run_of(report.USER_27B_FLAGS)) == replace(report.USER_27B, reference="base")


COLOCATED = {"train.colocate_all": True, "ref.num_gpus_per_node": 8}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"algo.kl.init_coef": 0}, {"reference": "none"}),
        ({"ref.offload": True, "sync.reference_from_base": False}, {"reference": "cpu"}),
        ({"ref.offload": True}, {"reference": "base"}),
        ({**COLOCATED, "vllm.enable_sleep": True, "sync.vllm_sleep_level": 2}, {"vllm_sleep_level": 2}),
        ({**COLOCATED, "vllm.enable_sleep": False, "sync.vllm_sleep_level": 2}, {"vllm_sleep_level": 0}),
        ({**COLOCATED, "vllm.enable_sleep": True}, {"vllm_sleep_level": 1}),
        # OpenRLHF turns vLLM sleep off without colocate_all (its post-parse code, through run.args)
        ({"vllm.enable_sleep": True}, {"vllm_sleep_level": 0}),
        ({"sync.bucket_mb": 64}, {"bucket_mb": 64}),
        ({}, {"bucket_mb": 128, "transport": "auto", "param_offload": False}),
        ({"sync.transport": "broadcast"}, {"transport": "broadcast"}),
        ({"trainer.offload_params": True, "ds.zero_stage": 3}, {"param_offload": True}),
        ({"ds.lora.rank": 8}, {"reference": "base", "lora_rank": 8}),
        ({"ds.lora.rank": 8, "sync.reference_from_base": False}, {"reference": "gpu"}),
        ({"ds.lora.rank": 8, "algo.kl.init_coef": 0}, {"reference": "none"}),
        ({"ds.lora.target_modules": "[q_proj,v_proj]"}, {"lora_targets": ("q_proj", "v_proj")}),
        ({}, {"lora_targets": "all-linear", "zero_stage": 2, "gpus": 16, "vllm_engines": 8}),
        (
            {"actor.num_gpus_per_node": 2, "vllm.tensor_parallel_size": 2, "ref.num_gpus_per_node": 2},
            {"gpus": 4, "vllm_engines": 1, "colocate": False},
        ),
    ],
)
def test_settings_from_the_recipe_path(flags, expected):
    settings = mb.shape_from_run(run_of({"ds.lora.rank": 64, **flags}))
    assert {key: getattr(settings, key) for key in expected} == expected


def test_the_users_27b_does_not_fit_at_sync_and_param_offload_makes_it_fit(spec_27b):
    as_given = mb.estimate(spec_27b, report.USER_27B)
    assert not as_given.fits("sync")
    lean = mb.estimate(spec_27b, replace(LEAN_AT_08, gpu_memory_utilization=0.3))
    # Even without the reference and with a small vLLM budget, both bf16 copies exceed a 24 GiB card.
    assert lean.phase("sync").total > lean.usable
    assert 2 * 2 * spec_27b.total_parameters / 4 > 24 * GIB
    changes, fitting = mb.find_fitting(spec_27b, report.USER_27B)
    assert any("parameter offload" in change for change in changes)
    assert mb.estimate(spec_27b, fitting).fits()


def test_the_table_answers_which_qwen35_fits_comfortably():
    budgets = {b.model.rsplit(", util", 1)[0]: b for b in report.table_rows()}
    nine = budgets["9B, TP4"]  # the layout of recipes/qwen3_5-9b-4x4090.yaml
    assert nine.fits() and nine.kv_sequences > 64
    # Comfortably: training and the full sync leave at least 5 GiB of the 24.
    assert all(nine.phase(name).total < 19 * GIB for name in ("train", "sync"))
    assert budgets["9B, 2 engines x TP2"].fits()
    assert not budgets["27B, KL 0, language-only LoRA"].fits("sync")
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
    assert report.main(["--table"]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == len(report.TABLE_ROWS) + 1  # the header and one row per setting
    (tmp_path / "config.json").write_text(json.dumps(CONFIG_CASES["qwen3_5 default interval"]))
    flags = ["actor.num_gpus_per_node=1", "ds.lora.rank=8", "vllm.gpu_memory_utilization=0.9"]
    args = ["--model", str(tmp_path), "--json", *(f"--set={flag}" for flag in flags)]
    assert report.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["lora_parameters"] > 0
    assert report.main(["--model", "Qwen/Qwen3.5-27B", "--set", "actor.num_gpus_per_node=4"]) == 1
    # a model with no config anywhere: one line naming it, exit 2
    assert report.main(["--model", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith(f"memory_budget: {tmp_path / 'missing'}: no config.json")


ROOT = Path(__file__).resolve().parents[2]
MEMORY_LINE = re.compile(
    r"# memory \(GiB/GPU, from scripts/memory_budget.py\): rollout ([\d.]+), train ([\d.]+), "
    r"sync ([\d.]+), delta sync ([\d.]+) of [\d.]+ usable; host RAM ([\d.]+) GiB per node; fits"
)


def has_model_config(path: Path) -> bool:
    """A GPU recipe whose model config is known. The CPU recipes' tiny model exists once a CPU run built it
    (in outputs/), but they have no memory header: no GPU."""
    model = recipe.load_recipe(path).get("actor.model_name_or_path")
    if not model or path.stem.endswith("-cpu"):
        return False
    return model in mi.REFERENCE_CONFIGS or (ROOT / model / "config.json").is_file()


MEMORY_PREFIX = recipe.MEMORY_LINE_PREFIX
RECIPES_WITH_A_MODEL = [p for p in sorted((ROOT / "recipes").glob("*.yaml")) if has_model_config(p)]


def peaks(text: str) -> tuple[str, ...]:
    """rollout, train, sync, delta sync and host RAM (GiB) from describe()'s lines."""
    phase = {m[1]: m[2] for m in re.finditer(r"^  (\w+) +\(\w+\): ([\d.]+) GiB", text, re.MULTILINE)}
    host = re.search(r"host RAM \(node\): ([\d.]+) GiB", text)[1]
    return (phase["rollout"], phase["train"], phase["sync"], phase["sync_delta"], host)


@pytest.mark.parametrize("path", RECIPES_WITH_A_MODEL, ids=lambda p: p.stem)
def test_cli_recipe_gives_the_numbers_of_its_header(path, capsys):
    assert report.main(["--recipe", str(path)]) == 0  # each recipe fits, as its header says
    header = MEMORY_LINE.search(path.read_text())
    out = capsys.readouterr().out
    assert peaks(out) == header.groups()
    # The last line is the header's memory line, verdict included.
    (header_line,) = [line for line in path.read_text().splitlines() if line.startswith(MEMORY_PREFIX)]
    assert out.splitlines()[-1] == "memory: " + header_line.removeprefix(MEMORY_PREFIX)
    assert header_line.endswith("; fits")
    assert report.main(["--recipe", path.stem]) == 0  # a bare name in recipes/, as run_grpo_lora.sh takes


def test_cli_model_alone_is_judged_with_this_repos_base_recipe(capsys):
    assert report.main(["--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--json"]) == 1  # base.yaml's layout: no
    result = json.loads(capsys.readouterr().out)
    settings = result["settings"]
    assert result["fits"] is False
    # base.yaml: 4 GPUs, ZeRO-3, colocated, LoRA r=64, KL 0; vllm.tensor_parallel_size null -> OpenRLHF's 1
    assert (settings["gpus"], settings["zero_stage"], settings["colocate"]) == (4, 3, True)
    assert (settings["lora_rank"], settings["reference"], settings["vllm_tp"]) == (64, "none", 1)
    # Negative control: the settings are read from the run, not fixed: a --set of OpenRLHF's own defaults
    # (ZeRO-2, 8 GPUs a node) shows in them.
    for override in ("--set=ds.zero_stage=2", "--set=actor.num_gpus_per_node=8"):
        # neither fits
        assert report.main(["--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--json", override]) == 1
    zero2, eight = (json.loads(line)["settings"] for line in capsys.readouterr().out.splitlines())
    assert zero2["zero_stage"] == 2 and eight["gpus"] == 8
    # The README's 7B fits with its recipe's layout (2 engines x TP2, util 0.77), given here as overrides.
    layout = ["vllm.num_engines=2", "vllm.tensor_parallel_size=2", "vllm.gpu_memory_utilization=0.77"]
    args = ["--model", "Qwen/Qwen2.5-VL-7B-Instruct", *(f"--set={item}" for item in layout)]
    assert report.main(args) == 0
    capsys.readouterr()
    assert report.main(["--recipe", "recipes/base.yaml", "--model", "Qwen/Qwen2.5-VL-7B-Instruct"]) == 1
    out = capsys.readouterr().out
    assert "Qwen/Qwen2.5-VL-7B-Instruct: 8.29 B parameters" in out
    # The verdict line names each phase over with its numbers, and the cheapest fix the estimator knows.
    last = out.splitlines()[-1]
    assert last.startswith("memory: rollout ") and "; does not fit: " in last, last
    assert "sync 23.9 > 23.5 GiB" in last and "; cheapest fix: " in last, last


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "ds.lora.rnak=64"],
            "ds.lora.rnak: not an OpenRLHF 0.11.2 train_ppo_ray flag nor a repo key",
        ),
        (["--set", "ds.lora.rank=-4"], "ds.lora.rank"),
        (["--set", "sync.bucket_mb=0"], "sync.bucket_mb"),
        (["--recipe", "no-such-recipe"], "no-such-recipe: no such recipe"),
        (["--set", "ds.lora.target_modules=[no_such_proj]"], "ds.lora.target_modules ('no_such_proj',)"),
        ([], "no model"),
    ],
)
def test_cli_bad_input_is_one_line_per_problem_exit_2(args, message, capsys):
    assert report.main(["--model", "Qwen/Qwen3.5-9B", *args] if args else args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert all(line.startswith("memory_budget: ") for line in err.splitlines())
    if "rnak" in message:
        assert "did you mean ds.lora.rank" in err
