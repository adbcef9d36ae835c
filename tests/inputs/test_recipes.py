"""Recipes (recipes/*.yaml), the recipe path (config/recipe.py) and run_grpo_lora.sh --dry-run.

Covers: every recipe passes OpenRLHF 0.11.2's own train_ppo_ray parser and post-parse checks; its header's
memory line is memory_budget.py's estimate; its LoRA targets, matched by peft's own rule against
the full-size model's module names, are every language-model linear and nothing of the vision tower; bad
keys, types, choices and switches fail naming the key; overrides, switches (store_true and store_false),
lists (nargs) and null map to the right flags; OpenRLHF's and upstream train()'s layout checks reject bad
layouts; the repo keys become the environment variables the patch and the reward read; wandb modes; the
run script's --dry-run prints the launch command without importing Ray, vLLM or DeepSpeed (torch only
builds the estimator's weightless model), picks
the default recipe by GPU presence (without one, the CPU learning run).
Does not cover: running a recipe (no GPU here) or preflight's checks (tests/inputs/test_preflight.py).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from openrlhf_lora_sync.config import config_checks, model_inventory
from openrlhf_lora_sync.config import recipe as rr
from openrlhf_lora_sync.testing.tiny_models import FAMILIES, build_config
from openrlhf_lora_sync.tools import render_recipe
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

from rewards import reward_file

ROOT = Path(__file__).resolve().parents[2]
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


def memory_headline(name: str, *overrides: str) -> str:
    return render_recipe.memory_report(rr.load_run(ROOT / "recipes" / name, overrides, NO_WANDB_KEY))[0]


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


def test_the_cpu_learning_run_takes_each_value_from_its_chain_its_overrides_or_openrlhf():
    """learn-cpu.yaml -> smoke-cpu.yaml -> base.yaml, loaded as tools/cpu_run.py loads it: the nearest file's
    value wins, an override wins over every file, and a key no file sets is OpenRLHF's own default."""
    run = rr.load_run("learn-cpu", ["rollout.batch_size=3"])
    base, smoke = (rr.load_recipe(ROOT / "recipes" / name) for name in ("base.yaml", "smoke-cpu.yaml"))
    rollout = run.args.rollout
    assert (
        rollout.max_new_tokens == 16 not in (smoke["rollout.max_new_tokens"], base["rollout.max_new_tokens"])
    )
    assert rollout.n_samples_per_prompt == 4 != base["rollout.n_samples_per_prompt"]  # smoke-cpu's
    assert rollout.batch_size == 3 != smoke["rollout.batch_size"]
    parser, _ = rr.openrlhf_parser()
    assert run.args.actor.adam.betas == parser.get_default("actor.adam.betas") is not None


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_header_states_hardware_memory_and_what_was_measured(recipe):
    header = [line for line in recipe.read_text().splitlines() if line.startswith("#")]
    memory = [line for line in header if line.startswith(rr.MEMORY_LINE_PREFIX)]
    assert len(memory) == 1
    assert any("GPU" in line for line in header)
    assert any("Measured" in line or "Nothing measured" in line for line in header)
    model = rr.load_recipe(recipe)["actor.model_name_or_path"]
    if model in model_inventory.REFERENCE_CONFIGS:
        regenerate = f"python scripts/render_recipe.py {recipe.name} --dry-run prints the current line"
        assert memory[0] == rr.MEMORY_LINE_PREFIX + memory_headline(recipe.name), regenerate


def model_config(flags: dict) -> dict:
    model = flags["actor.model_name_or_path"]
    if model in model_inventory.REFERENCE_CONFIGS:
        return model_inventory.REFERENCE_CONFIGS[model]
    family = model.rsplit("tiny-", 1)[1]  # the smoke recipe's tiny checkpoint, built on the fly
    return build_config(FAMILIES[family]).to_dict()


def linear_parts(config: dict) -> dict[str, str]:
    """Every nn.Linear of the model OpenRLHF would build (weightless) -> vision, lm_head or layers."""
    model = config_checks.meta_model(config)
    parts = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            vision = "visual" in name.split(".")
            parts[name] = "vision" if vision else "lm_head" if name.endswith("lm_head") else "layers"
    return parts


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_lora_targets_every_language_model_linear_and_no_vision_module(recipe):
    flags = rr.load_recipe(recipe)
    linears = linear_parts(model_config(flags))
    written = flags["ds.lora.target_modules"]  # a rule (lora_targets.RULES) or a short list, never 84 names
    assert isinstance(written, str) or len(written) <= 20, written
    # OpenRLHF hands peft the flag's list (a rule expanded by the renderer); peft's own matcher decides, on
    # the full-size model's names.
    lora = LoraConfig(target_modules=rr.dry_run(rendered(flags).argv)[0].ds.lora.target_modules)
    matched = {(part, name) for name, part in linears.items() if check_target_module_exists(lora, name)}
    # The CPU learning run adapts lm_head alone, on purpose (its header says why).
    parts = {"lm_head"} if recipe.stem == "learn-cpu" else {"layers"}
    assert {part for part, _ in matched} == parts
    assert matched == {(part, name) for name, part in linears.items() if part in parts}
    assert {"vision", "layers"} <= set(linears.values())  # the classification sees both towers


def test_the_users_27b_recipe_keeps_their_flags_and_kl_and_fits_with_the_offload():
    flags = recipe_flags("qwen3_5-27b-4x4090.yaml")
    result = rendered(flags)
    command = " ".join(result.argv)
    for flag in [*USERS_FLAGS, "--algo.kl.init_coef 0.01"]:
        assert f"{flag} " in command + " ", flag
    assert result.env["LORA_SYNC_OFFLOAD_PARAMS"] == "1" and result.env["LORA_SYNC_VLLM_SLEEP_LEVEL"] == "2"
    assert result.env["LORA_SYNC_REFERENCE_FROM_BASE"] == "1"
    headline = memory_headline("qwen3_5-27b-4x4090.yaml")
    assert headline.endswith("; fits") and "host RAM 81.9 GiB per node" in headline
    # Negative controls: without the offload, or with upstream's reference model, it does not fit.
    for override in ("trainer.offload_params=false", "sync.reference_from_base=false"):
        assert "does not fit: " in memory_headline("qwen3_5-27b-4x4090.yaml", override)


@pytest.mark.parametrize("overrides", [(), ("algo.kl.init_coef=0.01",)])
def test_run_script_dry_run_says_the_27b_recipe_fits(tmp_path, overrides):
    done = run_script(tmp_path, str(ROOT / "recipes" / "qwen3_5-27b-4x4090.yaml"), *overrides, "--dry-run")
    assert done.returncode == 0, done.stderr
    memory = [line for line in done.stdout.splitlines() if line.startswith(rr.MEMORY_LINE_PREFIX)]
    assert len(memory) == 1 and memory[0].endswith("; fits"), done.stdout
    assert "--algo.kl.init_coef 0.01" in done.stdout and "LORA_SYNC_OFFLOAD_PARAMS=1" in done.stdout


# ----------------------------------------------------------------------------------- run script


def run_script(tmp_path: Path, *args: str, gpu: bool | None = None) -> subprocess.CompletedProcess:
    """scripts/run_grpo_lora.sh with Python unable to import ray, vllm or deepspeed (so a dry run that
    started anything would fail; torch stays importable: the memory estimate builds a weightless model),
    and a stand-in nvidia-smi when `gpu` is given."""
    poison = tmp_path / "poison"
    for module in ("ray", "vllm", "deepspeed"):
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
    assert "python -m openrlhf_lora_sync.patch.launch" in done.stdout
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
