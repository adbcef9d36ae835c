"""LoRA targets named by rule (config/lora_targets.py), as the renderer expands them.

Covers: per family (Qwen2.5-VL, Qwen3-VL, Qwen3.5 at their published shapes) and per rule, peft's
get_peft_model with OpenRLHF's LoraConfig on the weightless model adapts exactly the language model's
decoder-layer linears the rule names and no vision module; the expansion follows the model's own config
(a local config.json with fewer layers gives fewer names); the renderer's argv and --dry-run carry it.
Negative controls: Qwen2.5-VL's bare MLP names reach its vision tower (what the check catches); an unknown
rule, a rule among module names and a rule without a model are refused in one line naming the fix.
Does not cover: whether the sync merges the targets (config_checks.target_problems,
tests/inputs/test_config_checks.py).
"""

from __future__ import annotations

import json
import re

import pytest
from openrlhf_lora_sync.config import lora_targets, model_inventory
from openrlhf_lora_sync.config import recipe as rr
from openrlhf_lora_sync.tools import render_recipe

# The decoder-layer linears of the language model, by the part of the layer they sit in.
LANGUAGE_LINEAR = re.compile(r"^model\.language_model\.layers\.\d+\.(self_attn|linear_attn|mlp)\.\w+$")
RULE_PARTS = {
    "language-linears": {"self_attn", "linear_attn", "mlp"},
    "language-attention": {"self_attn", "linear_attn"},
    "language-mlp": {"mlp"},
}
FAMILIES = ["Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3.5-27B"]
CASES = [(model, rule) for model in FAMILIES for rule in lora_targets.RULES]


def adapted(model: str, targets) -> frozenset[str]:
    """The modules peft wraps (OpenRLHF's LoraConfig, the weightless model of `model`'s config)."""
    spec = model_inventory.model_spec(model_inventory.load_config(model))
    return model_inventory.lora_inventory(spec, 8, tuple(targets)).modules


def language_linears(model: str, parts: set[str]) -> set[str]:
    spec = model_inventory.model_spec(model_inventory.load_config(model))
    return {
        m.name
        for m in spec.modules
        if m.linear and (found := LANGUAGE_LINEAR.match(m.name)) and found.group(1) in parts
    }


def test_the_rules_are_the_ones_tested():
    assert set(lora_targets.RULES) == set(RULE_PARTS)


@pytest.mark.parametrize(("model", "rule"), CASES, ids=[f"{m.split('/')[1]}-{r}" for m, r in CASES])
def test_a_rule_adapts_exactly_the_language_linears_it_names(model, rule):
    names, note = lora_targets.expand(rule, model)
    wrapped = adapted(model, names)
    expected = language_linears(model, RULE_PARTS[rule])
    assert wrapped == expected and expected
    assert not [name for name in wrapped if ".visual." in name]
    assert len(names) <= 100 and f"{rule} -> {len(names)} names on {model}" in note
    layers = model_inventory.load_config(model).get("text_config", model_inventory.load_config(model))
    if model.startswith("Qwen/Qwen2.5-VL") and rule != "language-attention":
        # The vision MLPs share the bare names: the expansion names each decoder layer's MLP instead.
        assert f"layers.{layers['num_hidden_layers'] - 1}.mlp.down_proj" in names and "down_proj" not in names
    if model.startswith("Qwen/Qwen3.5") and rule != "language-mlp":
        assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"} <= set(names)


def test_bare_mlp_names_reach_qwen2_5_vls_vision_tower():  # the negative control of the check above
    model = "Qwen/Qwen2.5-VL-7B-Instruct"
    wrapped = adapted(model, ["gate_proj", "up_proj", "down_proj"])
    assert any(".visual.blocks." in name for name in wrapped)
    assert wrapped != language_linears(model, {"mlp"})


def test_the_expansion_follows_the_models_own_config(tmp_path):
    config = json.loads(json.dumps(model_inventory.REFERENCE_CONFIGS["Qwen/Qwen2.5-VL-3B-Instruct"]))
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    names, note = lora_targets.expand("language-mlp", str(tmp_path))
    assert names == [f"layers.{i}.mlp.{p}" for i in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    assert "from its config.json" in note


def test_the_renderer_expands_a_rule_and_dry_run_shows_it(capsys):
    run = rr.load_run("qwen2_5_vl-7b-4x4090", environ={})
    assert run.flags["ds.lora.target_modules"] == "language-linears"
    targets = run.args.ds.lora.target_modules
    assert targets[:4] == ["q_proj", "k_proj", "v_proj", "o_proj"] and len(targets) == 4 + 3 * 28
    assert render_recipe.main(["qwen2_5_vl-7b-4x4090", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "layers.27.mlp.down_proj" in out and "# ds.lora.target_modules language-linears -> 88 names" in out
    # A hand list stays a hand list.
    run = rr.load_run("qwen2_5_vl-7b-4x4090", ["ds.lora.target_modules=[q_proj, v_proj]"], environ={})
    assert run.args.ds.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("ds.lora.target_modules=language-linear", "'language-linear' is not a target rule; the rules: "),
        ("ds.lora.target_modules=[q_proj, language-mlp]", "a rule (language-mlp) stands alone"),
        (
            "actor.model_name_or_path=null",
            "no model to expand the rule language-linears on: set actor",
        ),
        ("actor.model_name_or_path=/no/such/model", "/no/such/model: no config.json there"),
    ],
)
def test_a_bad_rule_is_refused_in_one_line(override, says):
    with pytest.raises(rr.RecipeError) as raised:
        rr.load_run("qwen3_vl-8b-4x4090", [override], environ={})
    lines = [line for line in str(raised.value).splitlines() if "target_modules" in line]
    assert len(lines) == 1 and says in lines[0], str(raised.value)
    if "not a target rule" in says:
        assert all(rule in lines[0] for rule in lora_targets.RULES)
