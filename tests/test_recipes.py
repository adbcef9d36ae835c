"""Recipes (recipes/*.yaml), their renderer (scripts/render_recipe.py) and scripts/run_grpo_lora.sh --dry-run.

Covers: every recipe passes OpenRLHF 0.11.2's own train_ppo_ray parser and post-parse checks; its header's
memory line is scripts/memory_budget.py's estimate; its LoRA targets, matched by peft's own rule against
the full-size model's module names, are every language-model linear and nothing of the vision tower; bad
keys, types, choices and switches fail naming the key; overrides, switches (store_true and store_false),
lists (nargs) and null map to the right flags; OpenRLHF's and upstream train()'s layout checks reject bad
layouts; the repo keys become the environment variables the patch and the reward read; wandb modes; the
run script's --dry-run prints the launch command without importing Ray, vLLM, torch or DeepSpeed, picks
the default recipe by GPU presence (without one, the CPU learning run).
Does not cover: running a recipe (no GPU here) or preflight's checks (tests/test_preflight.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from openrlhf_lora_sync.tiny_models import FAMILIES, build_config
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists

from rewards import reward_file
from scripts import memory_budget, preflight
from scripts import render_recipe as rr

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.name != "base.yaml")
BASE = ROOT / "recipes" / "base.yaml"
NO_WANDB_KEY = {"HOME": "/nonexistent"}
USERS_FLAGS = [
    "--train.colocate_all",
    "--vllm.enable_sleep",
    "--ds.enable_sleep",
    "--ds.lora.rank 64",
    "--ds.zero_stage 3",
    "--algo.advantage.estimator group_norm",
    "--vllm.num_engines 1",
    "--vllm.tensor_parallel_size 4",
]


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


# ------------------------------------------------------------------------------------------ recipes


def test_there_are_the_recipes_the_issue_asks_for():
    names = {p.name for p in RECIPES}
    assert {
        "qwen3_5-27b-4x4090.yaml",
        "qwen3_5-9b-4x4090.yaml",
        "qwen2_5_vl-7b-4x4090.yaml",
        "qwen3_vl-8b-4x4090.yaml",
        "qwen2_5_vl-3b-1gpu.yaml",
        "smoke-cpu.yaml",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_passes_openrlhfs_own_parser(recipe):
    flags = rr.load_recipe(recipe)
    args, _ = rr.dry_run(rendered(flags).argv)
    assert args.algo.advantage.estimator == "group_norm"
    assert args.ds.lora.rank > 0 and args.ds.zero_stage == 3
    assert args.data.max_images_per_prompt == 1 and args.critic.model_name_or_path is None
    # The math reward, except the CPU learning run's task (rewards/ascii_fraction.py): a registered file.
    expected = "ascii_fraction" if recipe.stem == "learn-cpu" else "math_answer"
    assert [ROOT / url for url in args.reward.remote_url] == [reward_file(expected)]
    assert args.actor.model_name_or_path == flags["actor.model_name_or_path"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_header_states_hardware_memory_and_what_was_measured(recipe):
    header = [line for line in recipe.read_text().splitlines() if line.startswith("#")]
    memory = [line for line in header if line.startswith(rr.MEMORY_LINE_PREFIX)]
    assert len(memory) == 1
    assert any("GPU" in line for line in header)
    assert any("Measured" in line or "Nothing measured" in line for line in header)
    model = rr.load_recipe(recipe)["actor.model_name_or_path"]
    if model in memory_budget.REFERENCE_CONFIGS:
        regenerate = f"python scripts/render_recipe.py {recipe.name} --dry-run prints the current line"
        assert memory[0] == rr.MEMORY_LINE_PREFIX + rr.memory_report(rr.load_recipe(recipe))[0], regenerate


def model_config(flags: dict) -> dict:
    model = flags["actor.model_name_or_path"]
    if model in memory_budget.REFERENCE_CONFIGS:
        return memory_budget.REFERENCE_CONFIGS[model]
    family = model.rsplit("tiny-", 1)[1]  # the smoke recipe's tiny checkpoint, built on the fly
    return build_config(FAMILIES[family]).to_dict()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_lora_targets_every_language_model_linear_and_no_vision_module(recipe):
    flags = rr.load_recipe(recipe)
    spec = memory_budget.model_spec(model_config(flags))
    # OpenRLHF hands peft the flag's list; peft's own matcher decides, on the full-size model's names.
    lora = LoraConfig(target_modules=flags["ds.lora.target_modules"])
    linears = {(group.part, name) for group in spec.modules if group.linear for name in group.names()}
    matched = {(part, name) for part, name in linears if check_target_module_exists(lora, name)}
    # The CPU learning run adapts lm_head alone, on purpose (its header says why).
    parts = {"lm_head"} if recipe.stem == "learn-cpu" else {"layers"}
    assert {part for part, _ in matched} == parts
    assert matched == {(part, name) for part, name in linears if part in parts}


def test_the_users_27b_recipe_keeps_their_flags_and_kl_and_fits_with_the_offload():
    flags = recipe_flags("qwen3_5-27b-4x4090.yaml")
    result = rendered(flags)
    command = " ".join(result.argv)
    for flag in [*USERS_FLAGS, "--algo.kl.init_coef 0.01"]:
        assert f"{flag} " in command + " ", flag
    assert result.env["LORA_SYNC_OFFLOAD_PARAMS"] == "1" and result.env["LORA_SYNC_VLLM_SLEEP_LEVEL"] == "2"
    assert result.env["LORA_SYNC_REFERENCE_FROM_BASE"] == "1"
    headline = rr.memory_report(flags)[0]
    assert headline.endswith("; fits") and "host RAM 81.9 GiB per node" in headline
    # Negative controls: without the offload, or with upstream's reference model, it does not fit.
    for override in ("trainer.offload_params=false", "sync.reference_from_base=false"):
        assert "does NOT fit" in rr.memory_report(recipe_flags("qwen3_5-27b-4x4090.yaml", override))[0]


@pytest.mark.parametrize("overrides", [(), ("algo.kl.init_coef=0.01",)])
def test_run_script_dry_run_says_the_27b_recipe_fits(tmp_path, overrides):
    done = run_script(tmp_path, str(ROOT / "recipes" / "qwen3_5-27b-4x4090.yaml"), *overrides, "--dry-run")
    assert done.returncode == 0, done.stderr
    memory = [line for line in done.stdout.splitlines() if line.startswith(rr.MEMORY_LINE_PREFIX)]
    assert len(memory) == 1 and memory[0].endswith("; fits"), done.stdout
    assert "--algo.kl.init_coef 0.01" in done.stdout and "LORA_SYNC_OFFLOAD_PARAMS=1" in done.stdout


# ------------------------------------------------------------------------------------ bad recipes


def test_unknown_key_fails_naming_it_with_close_matches(tmp_path):
    path = write_recipe(tmp_path, {"actor.model_name_or_path": "m", "vllm.tensor_paralel_size": 2})
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
    assert rr.main([str(path), "--dry-run"]) == 2
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
        ("sync.vllm_sleep_level", 3, "is not one of"),
        ("sync.bucket_mb", "big", "expected int"),
        ("reward.answer_format", "latex", "is not one of"),
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
        "eval.dataset=",
    )
    args, _ = rr.dry_run(rendered(flags).argv)
    assert (args.ds.lora.rank, args.rollout.batch_size) == (32, 16)
    assert args.ds.lora.target_modules == ["q_proj", "v_proj"]
    assert args.actor.adam.lr == 2e-6 and args.logger.wandb.run_name == "try:3"
    assert args.eval.dataset is None


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
    assert args.ds.lora.target_modules == rr.load_recipe(BASE)["ds.lora.target_modules"]


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
        "LORA_SYNC_TRANSPORT": "shm",
        "LORA_SYNC_MODE": "adapter",
        "LORA_SYNC_BUCKET_MB": "256",
        "LORA_SYNC_FORCE_FULL": "1",
        "LORA_SYNC_VLLM_SLEEP_LEVEL": "2",
        "LORA_SYNC_PROBE_EVERY": "1",
        "LORA_SYNC_REFERENCE_FROM_BASE": "1",
        "LORA_SYNC_OFFLOAD_PARAMS": "0",
    }
    repo_flags = [token for token in result.argv if token[2:] in rr.REPO_KEYS]
    assert not repo_flags


def test_repo_keys_match_what_their_readers_accept():
    from openrlhf_lora_sync import offload
    from openrlhf_lora_sync.transport import TRANSPORT_CHOICES

    assert rr.REPO_KEYS[offload.RECIPE_KEY][0] == offload.ENV

    parser, _ = rr.openrlhf_parser()
    assert not [key for key in rr.REPO_KEYS if f"--{key}" in parser._option_string_actions]
    assert set(rr.SYNC_TRANSPORTS) == set(TRANSPORT_CHOICES)
    assert rr.REPO_KEYS["sync.mode"][1]["choices"] == ("merge", "adapter")  # openrlhf_patch.sync_mode()


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
    monkeypatch.setattr(rr.os, "execve", lambda *call: calls.append(call))
    monkeypatch.setenv("HOME", "/nonexistent")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    rr.main(["qwen3_vl-8b-4x4090", "ds.lora.rank=16", "--exec"])
    executable, command, env = calls[0]
    assert executable == sys.executable
    assert command[:3] == [sys.executable, "-m", "openrlhf_lora_sync.launch"]
    assert command[command.index("--ds.lora.rank") + 1] == "16"
    assert env["LORA_SYNC_TRANSPORT"] == "auto" and env["WANDB_MODE"] == "offline"
    assert "openrlhf_lora_sync.launch" in capsys.readouterr().err


def test_resolved_recipe_is_the_merged_overridden_flags(tmp_path):
    out = tmp_path / "resolved.yaml"
    assert rr.main(["qwen3_vl-8b-4x4090", "ds.lora.rank=16", "--resolved", str(out)]) == 0
    assert rr.load_recipe(out) == recipe_flags("qwen3_vl-8b-4x4090.yaml", "ds.lora.rank=16")
    assert preflight.load_recipe(out)["ds.lora.rank"] == 16


# ----------------------------------------------------------------------------------- run script


def run_script(tmp_path: Path, *args: str, gpu: bool | None = None) -> subprocess.CompletedProcess:
    """scripts/run_grpo_lora.sh with Python unable to import ray, vllm, torch or deepspeed (so a dry run
    that started anything would fail), and a stand-in nvidia-smi when `gpu` is given."""
    poison = tmp_path / "poison"
    for module in ("ray", "vllm", "torch", "deepspeed"):
        (poison / module).mkdir(parents=True, exist_ok=True)
        (poison / module / "__init__.py").write_text(f"raise ImportError('a dry run imported {module}')\n")
    env = {**os.environ, "PYTHONPATH": str(poison), "HOME": str(tmp_path)}
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        env.pop(name, None)
    if gpu is not None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        listing = "echo 'GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-0)'" if gpu else "exit 9"
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{listing}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
    script = str(ROOT / "scripts" / "run_grpo_lora.sh")
    return subprocess.run(
        ["bash", script, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )


def test_run_script_dry_run_prints_the_launch_command(tmp_path):
    done = run_script(tmp_path, "qwen3_vl-8b-4x4090", "rollout.batch_size=16", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "python -m openrlhf_lora_sync.launch" in done.stdout
    assert "--rollout.batch_size 16" in done.stdout and "LORA_SYNC_TRANSPORT=auto" in done.stdout
    assert "nothing started" in done.stdout


def test_run_script_bad_key_exits_2_naming_it(tmp_path):
    done = run_script(tmp_path, "qwen3_vl-8b-4x4090", "ds.lora.rnak=8", "--dry-run")
    assert done.returncode == 2 and "ds.lora.rnak" in done.stderr and "ds.lora.rank" in done.stderr


def test_run_script_defaults_to_the_gpu_recipe_when_a_gpu_is_listed(tmp_path):
    done = run_script(tmp_path, "--dry-run", gpu=True)
    assert done.returncode == 0, done.stderr
    assert "qwen2_5_vl-7b-4x4090" in done.stderr and "Qwen/Qwen2.5-VL-7B-Instruct" in done.stdout


def test_run_script_without_gpu_or_recipe_picks_the_cpu_learning_recipe(tmp_path):
    done = run_script(tmp_path, "--dry-run", gpu=False)
    assert done.returncode == 0, done.stderr
    assert "learn-cpu.yaml" in done.stderr and "nothing started" in done.stdout


def test_sync_bucket_default_is_the_same_in_the_recipe_the_patch_and_the_memory_budget():
    # Three places hold the default (the user-facing recipe, the patch's fallback when LORA_SYNC_BUCKET_MB
    # is unset, the memory estimator's Settings); this keeps them one value.
    from openrlhf_lora_sync.sync import DEFAULT_BUCKET_BYTES

    recipe_mb = yaml.safe_load(BASE.read_text())["sync.bucket_mb"]
    assert recipe_mb == DEFAULT_BUCKET_BYTES >> 20 == memory_budget.Settings.bucket_mb
