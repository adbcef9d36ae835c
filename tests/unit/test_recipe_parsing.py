"""The recipe path's pure logic (recipe.py, settings.py's use in it): loading, overrides, every bad key and
value named with its fix, the mapping to flags and environment variables, OpenRLHF's own parser and
checks, wandb modes, and the render CLI's exits. Fast: no engine, no model, no torch (`pytest tests/unit`).
Recipes themselves and run_grpo_lora.sh are tests/inputs/test_recipes.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.config import lora_targets, memory_budget
from openrlhf_lora_sync.config import recipe as rr
from openrlhf_lora_sync.tools import render_recipe

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "base.yaml"
NO_WANDB_KEY = {"HOME": "/nonexistent"}
MODEL = "Qwen/Qwen3-VL-8B-Instruct"  # a hub id with a reference config: the LoRA target rule expands on it


def rendered(flags: dict, environ=None) -> rr.Rendered:
    return rr.render(flags, environ=NO_WANDB_KEY if environ is None else environ)


def recipe_flags(name: str, *overrides: str) -> dict:
    return rr.apply_overrides(rr.load_recipe(ROOT / "recipes" / name), list(overrides))


def write_recipe(tmp_path: Path, body: dict) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"base": str(BASE), **body}))
    return path


def error_for(flags: dict) -> rr.RecipeError:
    with pytest.raises(rr.RecipeError) as caught:
        rr.dry_run(rendered(flags).argv)
    return caught.value


# ------------------------------------------------------------------------------------ bad recipes


def test_unknown_key_fails_naming_it_with_close_matches(tmp_path):
    path = write_recipe(tmp_path, {"actor.model_name_or_path": MODEL, "vllm.tensor_paralel_size": 2})
    with pytest.raises(rr.RecipeError) as caught:
        rendered(rr.load_recipe(path))
    message = str(caught.value)
    assert caught.value.keys == ("vllm.tensor_paralel_size",)
    assert (
        message.startswith("vllm.tensor_paralel_size: ")
        and "did you mean vllm.tensor_parallel_size" in message
    )


def test_cli_exits_nonzero_naming_the_bad_key_and_type(tmp_path, capsys):
    path = write_recipe(tmp_path, {"vllm.bogus_knob": 1, "vllm.tensor_parallel_size": "four"})
    assert render_recipe.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "vllm.bogus_knob: not an OpenRLHF" in err and "vllm.tensor_parallel_size: expected int" in err


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("vllm.tensor_parallel_size", "four", "expected int"),
        ("vllm.tensor_parallel_size", 2.5, "expected int"),
        ("ds.lora.rank", True, "expected int"),
        ("actor.adam.lr", "fast", "expected float"),
        ("algo.advantage.estimator", "grpo", "is not one of"),
        ("train.colocate_all", "yes", "expected true or false"),
        ("actor.eps_clip_low_high", [0.2], "expected a list of 2"),
        ("data.max_len", [1024, 2048], "expected one int"),
        ("sync.vllm_sleep_level", 3, "expected one of 1, 2"),
        ("sync.bucket_mb", "big", "expected an integer >= 1"),
        ("sync.bucket_mb", 0, "expected an integer >= 1"),
        ("sync.probe_every", -1, "expected an integer >= 0"),
        ("sync.mode", "", "empty value"),
        ("actor.model_name_or_path", " ", "empty value"),
        ("reward.answer_format", "latex", "expected one of boxed, think_answer"),
        ("sync.force_full", 1, "expected true or false"),
        ("trainer.offload_params", "yes", "expected true or false"),
    ],
)
def test_wrong_value_fails_naming_the_key_and_what_it_takes(key, value, expected):
    with pytest.raises(rr.RecipeError) as caught:
        rendered({**recipe_flags("qwen3_vl-8b-4x4090.yaml"), key: value})
    assert caught.value.keys == (key,)
    assert str(caught.value).startswith(f"{key}: ") and expected in str(caught.value)


def test_every_bad_key_is_reported_at_once():
    flags = {**recipe_flags("qwen3_vl-8b-4x4090.yaml"), "ds.lora.rank": "x", "nonsense.key": 1}
    with pytest.raises(rr.RecipeError) as caught:
        rendered(flags)
    assert set(caught.value.keys) == {"ds.lora.rank", "nonsense.key"}


@pytest.mark.parametrize("targets", ["all-linear", [r".*language_model.*\.(q_proj|v_proj)"]])
def test_lora_targets_that_peft_would_match_as_nothing_are_refused(targets):
    with pytest.raises(rr.RecipeError) as caught:
        rendered({**recipe_flags("qwen3_vl-8b-4x4090.yaml"), "ds.lora.target_modules": targets})
    assert "suffix" in str(caught.value) and caught.value.keys == ("ds.lora.target_modules",)


def test_a_key_given_twice_in_one_file_and_a_base_loop_are_errors(tmp_path):
    (tmp_path / "twice.yaml").write_text("ds.lora.rank: 8\nds.lora.rank: 16\n")
    with pytest.raises(rr.RecipeError, match="given twice"):
        rr.load_recipe(tmp_path / "twice.yaml")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(rr.RecipeError, match="loops"):
        rr.load_recipe(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.n_samples_per_prompt=1"], "requires n_samples_per_prompt > 1"),
        (["ds.packing_samples=true"], "does not support --packing_samples"),
        (["vllm.num_engines=1"], "actor GPUs"),
        (["algo.kl.init_coef=0.01"], "ref.num_gpus_per_node"),
        (["train.batch_size=66"], "multiple of train.micro_batch_size"),
    ],
)
def test_dry_run_applies_openrlhfs_and_upstream_trains_checks(overrides, message):
    assert message in str(error_for(recipe_flags("qwen3_vl-8b-4x4090.yaml", *overrides)))


def test_a_kl_reference_on_the_actors_gpus_passes():
    flags = recipe_flags("qwen3_vl-8b-4x4090.yaml", "algo.kl.init_coef=0.01", "ref.num_gpus_per_node=4")
    args, _ = rr.dry_run(rendered(flags).argv)
    assert args.algo.kl.init_coef == 0.01


# ---------------------------------------------------------------------------------------- mapping


def test_overrides_are_read_as_yaml_and_win_over_the_recipe():
    flags = recipe_flags(
        "qwen3_vl-8b-4x4090.yaml",
        "ds.lora.rank=32",
        "--rollout.batch_size=16",
        "ds.lora.target_modules=[q_proj, v_proj]",
        "actor.adam.lr=2e-6",
        "logger.wandb.run_name=try:3",
        "eval.dataset=null",
    )
    args, _ = rr.dry_run(rendered(flags).argv)
    assert (args.ds.lora.rank, args.rollout.batch_size) == (32, 16)
    assert args.ds.lora.target_modules == ["q_proj", "v_proj"]
    assert args.actor.adam.lr == 2e-6 and args.logger.wandb.run_name == "try:3"
    assert args.eval.dataset is None
    # `key=` with nothing after it is refused, not dropped: null is how a recipe leaves a flag out.
    with pytest.raises(rr.RecipeError, match="eval.dataset=null to leave it out"):
        rr.apply_overrides({}, ["eval.dataset="])


def test_switches_map_to_present_or_absent_flags_and_null_leaves_the_default():
    on = rendered(recipe_flags("qwen3_vl-8b-4x4090.yaml")).argv
    off = rendered(recipe_flags("qwen3_vl-8b-4x4090.yaml", "train.colocate_all=false", "ckpt.path=null")).argv
    assert "--train.colocate_all" in on and "--train.colocate_all" not in off
    assert "--ckpt.path" in on and "--ckpt.path" not in off
    assert "--ds.packing_samples" not in on  # not in the recipe: OpenRLHF's default


def test_turning_off_a_default_on_switch_uses_its_store_false_twin():
    argv = rendered(recipe_flags("qwen3_vl-8b-4x4090.yaml", "actor.muon.nesterov=false")).argv
    assert "--actor.muon.no_nesterov" in argv
    args, _ = rr.dry_run(argv)
    assert args.actor.muon.nesterov is False
    assert "--actor.muon.nesterov" not in rendered(recipe_flags("qwen3_vl-8b-4x4090.yaml")).argv


def test_lists_become_the_flags_values():
    argv = rendered(recipe_flags("qwen3_vl-8b-4x4090.yaml")).argv
    i = argv.index("--actor.eps_clip_low_high")
    assert argv[i + 1 : i + 3] == ["0.2", "0.28"]
    args, _ = rr.dry_run(argv)
    assert list(args.actor.eps_clip_low_high) == [0.2, 0.28]
    rule = rr.load_recipe(BASE)["ds.lora.target_modules"]  # expanded on the recipe's model
    assert args.ds.lora.target_modules == lora_targets.expand(rule, MODEL)[0]


def test_repo_keys_become_environment_variables_and_never_flags():
    flags = recipe_flags(
        "qwen3_vl-8b-4x4090.yaml",
        "sync.force_full=true",
        "sync.bucket_mb=256",
        "sync.vllm_sleep_level=2",
        "sync.transport=shm",
        "sync.mode=adapter",
        "reward.format_weight=0.2",
        "reward.answer_format=think_answer",
    )
    result = rendered(flags)
    assert {k: v for k, v in result.env.items() if k != "WANDB_MODE"} == {
        "REWARD_ACCURACY_WEIGHT": "1.0",
        "REWARD_FORMAT_WEIGHT": "0.2",
        "REWARD_ANSWER_FORMAT": "think_answer",
        "REWARD_VERIFY_TIMEOUT_S": "5.0",
        "REWARD_VERIFY_WORKERS": "2",
        "LORA_SYNC_TRANSPORT": "shm",
        "LORA_SYNC_MODE": "adapter",
        "LORA_SYNC_BUCKET_MB": "256",
        "LORA_SYNC_FORCE_FULL": "1",
        "LORA_SYNC_VLLM_SLEEP_LEVEL": "2",
        "LORA_SYNC_PROBE_EVERY": "1",
        "LORA_SYNC_GEN_KL_GATE": "0.001",
        "LORA_SYNC_GEN_KL_STOP": "0",
        "LORA_SYNC_REFERENCE_FROM_BASE": "1",
        "LORA_SYNC_OFFLOAD_PARAMS": "0",
        "LORA_SYNC_STALE_ENGINE_CONTROL": "0",
        "LORA_SYNC_ALLOW_UNTESTED_VERSIONS": "0",
    }
    repo_flags = [token for token in result.argv if token[2:] in settings.BY_KEY]
    assert not repo_flags


def test_base_recipe_sets_every_repo_key_with_its_variable_named():
    """base.yaml is the commented list of the repo keys a recipe can set: each one settings.SETTINGS has,
    its comment naming the variable it becomes, and none of them an OpenRLHF flag."""
    lines = {line.split(":", 1)[0]: line for line in BASE.read_text().splitlines() if "# repo ->" in line}
    assert set(lines) == set(settings.BY_KEY)
    for key, line in lines.items():
        assert f"# repo -> {settings.BY_KEY[key].env}:" in line, line
    parser, _ = rr.openrlhf_parser()
    assert not [key for key in settings.BY_KEY if f"--{key}" in parser._option_string_actions]


@pytest.mark.parametrize(
    ("mode", "environ", "wandb_mode", "key_flag"),
    [
        ("auto", {"WANDB_API_KEY": "k" * 40, "HOME": "/nonexistent"}, "online", True),
        ("auto", NO_WANDB_KEY, "offline", True),
        ("auto", {"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "offline"}, "offline", True),
        ("auto", {"WANDB_MODE": "disabled"}, "disabled", False),
        ("offline", {"WANDB_API_KEY": "k" * 40}, "offline", True),
        ("disabled", {"WANDB_API_KEY": "k" * 40}, "disabled", False),
    ],
)
def test_wandb_mode(mode, environ, wandb_mode, key_flag):
    result = rendered(recipe_flags("qwen3_vl-8b-4x4090.yaml", f"logger.wandb.mode={mode}"), environ)
    assert result.env["WANDB_MODE"] == wandb_mode
    assert ("--logger.wandb.key" in result.argv) == key_flag
    assert "k" * 40 not in result.argv  # the key stays in the environment


def test_wandb_auto_finds_a_netrc_key(tmp_path):
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert rr.wandb_has_credentials({"HOME": str(tmp_path)})
    assert not rr.wandb_has_credentials({"HOME": str(tmp_path / "elsewhere")})


def test_a_key_written_into_a_recipe_is_masked_when_printed():
    result = rendered(recipe_flags("qwen3_vl-8b-4x4090.yaml", "logger.wandb.key=secret123"))
    assert "secret123" in result.argv and "secret123" not in result.shell_command()


def test_exec_replaces_the_process_with_the_launcher(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(render_recipe.os, "execve", lambda *call: calls.append(call))
    monkeypatch.setenv("HOME", "/nonexistent")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    render_recipe.main(["qwen3_vl-8b-4x4090", "ds.lora.rank=16", "--exec"])
    executable, command, env = calls[0]
    assert executable == sys.executable
    assert command[:3] == [sys.executable, "-m", "openrlhf_lora_sync.patch.launch"]
    assert command[command.index("--ds.lora.rank") + 1] == "16"
    assert env["LORA_SYNC_TRANSPORT"] == "auto" and env["WANDB_MODE"] == "offline"
    assert "openrlhf_lora_sync.patch.launch" in capsys.readouterr().err


def test_resolved_recipe_is_the_merged_overridden_flags(tmp_path):
    out = tmp_path / "resolved.yaml"
    assert render_recipe.main(["qwen3_vl-8b-4x4090", "ds.lora.rank=16", "--resolved", str(out)]) == 0
    assert rr.load_recipe(out) == recipe_flags("qwen3_vl-8b-4x4090.yaml", "ds.lora.rank=16")
    assert rr.load_run(out, environ=NO_WANDB_KEY).args.ds.lora.rank == 16


def test_base_recipe_values_are_ones_their_settings_accept():
    """base.yaml writes each repo key's value out for people; each is one settings.py accepts, and the
    bucket size it writes is settings' default, which the estimator also assumes."""
    base = yaml.safe_load(BASE.read_text())
    for key in settings.BY_KEY:
        settings.BY_KEY[key].parse(base[key])
    assert (
        base["sync.bucket_mb"]
        == settings.BY_KEY["sync.bucket_mb"].default
        == memory_budget.RunShape.bucket_mb
    )
