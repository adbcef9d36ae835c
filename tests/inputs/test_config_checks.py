"""Bad configurations fail before any GPU work, each naming its fix; the same configuration fixed passes.

One case per configuration issue 6 lists, each run through the entry point that catches it first:
the recipe path (recipe.load_run: recipe keys, OpenRLHF's parser, config_checks.run_problems; no torch),
preflight's checks (the model built from its config on the meta device, the host's real pidfd_getfd
probe, denied for real), or the launcher's checks of hand-passed flags (recipe.run_from_argv +
config_checks.launch_problems). Every case also runs with the fix
applied and must pass, so a check that refused everything would fail here.

Does not cover: GPUs (the transport case gives preflight a GPU list), other releases actually installed
(the version case passes the installed versions in), the full preflight command line
(tests/inputs/test_preflight.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import ray
from openrlhf_lora_sync.config import config_checks, host_checks, preflight
from openrlhf_lora_sync.config import recipe as render_recipe
from openrlhf_lora_sync.patch import launch

RTX_4090 = host_checks.GpuInfo("NVIDIA GeForce RTX 4090", 23.99)
SMOKE = render_recipe.RECIPES_DIR / "smoke-cpu.yaml"


@dataclass(frozen=True)
class Case:
    name: str
    check: Callable  # (config, context) -> the failure text, or None when the configuration passes
    bad: object
    fixed: object
    fix_named: tuple[str, ...]  # what the failure text must say


def overrides_of(keys: dict) -> list[str]:
    return [f"{key}={value}" for key, value in keys.items()]


def smoke_run(keys: dict):
    return render_recipe.load_run(SMOKE, overrides_of(keys), environ={})


def via_render(keys: dict, context) -> str | None:
    try:
        smoke_run(keys)
    except render_recipe.RecipeError as error:
        return str(error)
    return None


def via_preflight_lora(keys: dict, context) -> str | None:
    try:
        run = smoke_run(keys)
    except render_recipe.RecipeError as error:  # what the recipe path refuses, preflight refuses first
        return str(error)
    result = preflight.check_lora_config(run, str(context["model"]))
    return f"{result.summary} fix: {result.fix}" if result.status == preflight.FAIL else None


def via_preflight_transport(keys: dict, context) -> str | None:
    result = preflight.check_transport(
        smoke_run(keys).setting("sync.transport"), [RTX_4090], context["denied_probe"]
    )
    return f"{result.summary} fix: {result.fix}" if result.status == preflight.FAIL else None


def via_versions(installed: dict, context) -> str | None:
    problems = config_checks.version_problems(installed)
    return "\n".join(map(str, problems)) or None


# What a launch needs beyond OpenRLHF's defaults to pass its own checks (a reward, GRPO groups).
LAUNCH_BASE = [
    "--reward.remote_url",
    "rewards/math_answer.py",
    "--algo.advantage.estimator",
    "group_norm",
    "--rollout.n_samples_per_prompt",
    "4",
]


def via_launcher_flags(argv: list[str], context, env: dict | None = None) -> str | None:
    argv = ["--actor.model_name_or_path", str(context["model"]), *LAUNCH_BASE, *argv]
    try:
        run = render_recipe.run_from_argv(argv, env or {})
    except render_recipe.RecipeError as error:
        return str(error)
    fatal = [p for p in config_checks.launch_problems(run, context["installed"]) if p.fatal]
    return "\n".join(map(str, fatal)) or None


CASES = [
    Case(
        "rank above adapter mode's vLLM limit",
        via_preflight_lora,
        {"ds.lora.rank": 1024, "sync.mode": "adapter", "ds.lora.target_modules": "[q_proj]"},
        {"ds.lora.rank": 512, "sync.mode": "adapter", "ds.lora.target_modules": "[q_proj]"},
        ("512", "sync.mode: merge"),
    ),
    Case(
        "target_modules matching nothing (vLLM's fused name)",
        via_preflight_lora,
        {"ds.lora.rank": 8, "ds.lora.target_modules": "[qkv_proj]"},
        {"ds.lora.rank": 8, "ds.lora.target_modules": "[q_proj, k_proj, v_proj]"},
        ("matches no module", "q_proj", "k_proj"),
    ),
    Case(
        "target_modules matching a Conv3d",
        via_preflight_lora,
        {"ds.lora.rank": 8, "ds.lora.target_modules": "[proj]"},
        {"ds.lora.rank": 8, "ds.lora.target_modules": "[attn.proj]"},
        ("Conv3d", "linear layers only"),
    ),
    Case(
        "adapter mode with LoRA on the vision tower (OpenRLHF's default all-linear)",
        via_preflight_lora,
        {"ds.lora.rank": 8, "sync.mode": "adapter", "ds.lora.target_modules": "null"},
        {"ds.lora.rank": 8, "sync.mode": "adapter", "ds.lora.target_modules": "[q_proj, v_proj]"},
        ("vision tower", "sync.mode: merge"),
    ),
    Case(
        # learn-cpu's own targets in adapter mode: the engine refused them at the first sync, inside Ray
        "adapter mode with LoRA on lm_head",
        via_preflight_lora,
        {"ds.lora.rank": 8, "sync.mode": "adapter", "ds.lora.target_modules": "[lm_head]"},
        {"ds.lora.rank": 8, "sync.mode": "merge", "ds.lora.target_modules": "[lm_head]"},
        ("output head", "leave lm_head out of target_modules", "sync.mode: merge"),
    ),
    Case(
        "non-LoRA run with the patch's LoRA options",
        via_render,
        {"ds.lora.rank": 0},
        {},
        ("ds.lora.rank > 0", "openrlhf.cli.train_ppo_ray", "ds.lora.alpha"),
    ),
    Case("DoRA", via_render, {"ds.lora.use_dora": True}, {}, ("remove ds.lora.use_dora", "plain LoRA")),
    Case(
        "OpenRLHF/vLLM release outside the supported ranges",
        via_versions,
        {"openrlhf": "0.10.1", "vllm": "0.29.0"},
        {"openrlhf": "0.11.0", "vllm": "0.29.0+cpu"},
        ("OpenRLHF 0.10.1 is outside >=0.11.0,<0.12", "scripts/setup_env.sh", "ALLOW_UNTESTED_VERSIONS"),
    ),
    Case(
        "transport the host forbids",
        via_preflight_transport,
        {"sync.transport": "cuda_ipc"},
        {"sync.transport": "shm"},
        ("pidfd_getfd", "sync.transport: shm"),
    ),
    Case(
        "trainer base offload without ZeRO-3",
        via_render,
        {"trainer.offload_params": True, "ds.zero_stage": 2},
        {"trainer.offload_params": True},
        ("ZeRO-3's parameter offload", "set ds.zero_stage: 3", "trainer.offload_params: false"),
    ),
    Case(
        "trainer base offload with a 4-bit base",
        via_render,
        {"trainer.offload_params": True, "ds.load_in_4bit": True},
        {"trainer.offload_params": True},
        ("4-bit", "remove ds.load_in_4bit"),
    ),
    Case(
        "trainer base offload set in the environment, launcher flags at OpenRLHF's default ZeRO stage",
        lambda argv, context: via_launcher_flags(argv, context, {"LORA_SYNC_OFFLOAD_PARAMS": "1"}),
        ["--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj"],
        ["--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj", "--ds.zero_stage", "3"],
        ("2 (OpenRLHF's default)", "set ds.zero_stage: 3"),
    ),
    Case(
        "the stale-engine control with vLLM sleep level 2 (the engine's weights discarded at each sleep)",
        via_render,
        {"sync.stale_engine_control": True, "vllm.enable_sleep": True, "sync.vllm_sleep_level": 2},
        {"sync.stale_engine_control": True, "vllm.enable_sleep": True, "sync.vllm_sleep_level": 1},
        ("sync.stale_engine_control", "sleep level 2", "sync.vllm_sleep_level: 1"),
    ),
    Case(
        "data.max_len above the model's max_position_embeddings (the tiny model's 4096)",
        via_preflight_lora,
        {"data.max_len": 8192},
        {"data.max_len": 4096},
        ("data.max_len", "max_position_embeddings 4096", "data.max_len: 4096 or less"),
    ),
    Case(
        "data.max_len above the model's length, launcher flags",
        via_launcher_flags,
        ["--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj", "--data.max_len", "5000"],
        ["--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj", "--data.max_len", "4000"],
        ("max_model_len", "data.max_len: 4096 or less"),
    ),
    Case(
        "flags passed by hand to the launcher",
        via_launcher_flags,
        ["--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj", "--ds.lora.use_dora"],
        ["--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj"],
        ("remove ds.lora.use_dora",),
    ),
]


@pytest.fixture(scope="module")
def context(tiny_model_dir):
    denied = host_checks.check_pidfd_getfd({}, force_denied=True)
    assert denied.details["errno"] == "EPERM", denied  # really denied, not simulated
    return {
        "model": tiny_model_dir("qwen2_5_vl"),
        "denied_probe": denied,
        "installed": {"openrlhf": "0.11.2", "vllm": "0.29.0"},
    }


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_configuration_fails_naming_the_fix_and_the_fixed_one_passes(case, context):
    failure = case.check(case.bad, context)
    assert failure is not None, f"{case.name}: not refused"
    missing = [fragment for fragment in case.fix_named if fragment not in failure]
    assert not missing, f"{case.name}: the message lacks {missing}:\n{failure}"
    assert case.check(case.fixed, context) is None


@pytest.mark.parametrize(
    ("overrides", "argv"),
    [
        ({"ds.zero_stage": 2}, ["--ds.zero_stage", "2"]),
        ({"ds.load_in_4bit": True}, ["--ds.load_in_4bit"]),
    ],
    ids=["zero2", "4bit"],
)
def test_offload_refusals_are_the_same_in_render_preflight_and_the_launcher(overrides, argv, context):
    """One refusal, three entry points: the recipe path (render, --dry-run, preflight --recipe) and the
    launcher (hand-passed flags with LORA_SYNC_OFFLOAD_PARAMS=1 in the environment)."""
    fixed = smoke_run({"trainer.offload_params": True})  # ZeRO-3 in smoke-cpu.yaml: passes
    assert config_checks.offload_problems(fixed) == []
    message = via_render({"trainer.offload_params": True, **overrides}, context)
    assert "trainer.offload_params:" in message and "fix:" in message
    assert via_preflight_lora({"trainer.offload_params": True, **overrides}, context) == message
    launcher_argv = [
        "--ds.lora.rank",
        "8",
        "--ds.lora.target_modules",
        "q_proj",
        "--ds.zero_stage",
        "3",
        *argv,
    ]
    launched = via_launcher_flags(launcher_argv, context, {"LORA_SYNC_OFFLOAD_PARAMS": "1"})
    problem = message.splitlines()[0]
    assert problem in launched or problem.replace("2 (OpenRLHF's default)", "2") in launched
    # The same flags without the offload pass (4-bit is refused by nothing else here).
    assert via_launcher_flags(launcher_argv, context, {"LORA_SYNC_OFFLOAD_PARAMS": "0"}) is None


def test_merge_mode_rank_above_a_targets_dimensions_warns_only(context):
    keys = {"ds.lora.rank": 200, "ds.lora.target_modules": "[q_proj]"}  # the tiny model's hidden size is 128
    result = preflight.check_lora_config(smoke_run(keys), str(context["model"]))
    assert result.status == preflight.WARN and "ds.lora.rank: 128 or less" in result.fix
    result = preflight.check_lora_config(smoke_run({**keys, "ds.lora.rank": 128}), str(context["model"]))
    assert result.status == preflight.PASS


@pytest.mark.parametrize(
    "family, mode, warned",
    [
        ("qwen3_5", "adapter", True),  # upstream vLLM: adapter LoRA a no-op / a crash on Qwen3.5 GPUs
        ("qwen3_5", "merge", False),  # merge mode sends plain weights: nothing of vLLM's LoRA involved
        ("qwen2_5_vl", "adapter", False),  # no such report for the other families
    ],
)
def test_adapter_mode_on_qwen3_5_warns_naming_the_vllm_issues(family, mode, warned, tiny_model_dir):
    keys = {"sync.mode": mode, "ds.lora.target_modules": "[q_proj, v_proj]"}
    result = preflight.check_lora_config(smoke_run(keys), str(tiny_model_dir(family)))
    if warned:
        assert result.status == preflight.WARN and "#49354" in result.summary + result.fix, result
        assert "sync.mode: merge" in result.fix
    else:
        assert result.status == preflight.PASS, result


def test_launcher_refuses_before_starting_ray(context, capsys):
    argv = ["--actor.model_name_or_path", str(context["model"]), *LAUNCH_BASE, "--ds.lora.rank", "0"]
    assert launch.main(argv) == 2
    assert "ds.lora.rank > 0" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_launcher_removes_the_runs_shm_files_however_training_ends(context, monkeypatch):
    """Actors Ray ends may leave their kept /dev/shm bucket files; the launcher removes its run's (and
    only its run's) once train_ppo_ray is done, here by raising."""
    import os
    import signal

    import torch
    from openrlhf_lora_sync.sync import transport

    monkeypatch.setenv(transport.RUN_ID_ENV, "test-run-cleanup")
    # The launcher sets these in its own environment; restored after the test.
    for name in ("LORA_SYNC_LORA_RANK", "LORA_SYNC_WORKDIR", "WANDB_DIR", "DS_ACCELERATOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's own SIGTERM handling
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    other_run = os.path.join(transport.SHM_DIR, f"{transport.SHM_FILE_PREFIX}other-run-1-x.bin")
    open(other_run, "wb").close()
    left = []

    def train_ppo_ray_that_dies(*args, **kwargs):
        slots = transport.ShmSlots(2)  # an actor's slots, never closed
        for _ in range(2):
            left.append(slots.stage([("w", torch.ones(4))]).path)
        raise RuntimeError("injected: training died")

    monkeypatch.setattr(launch.runpy, "run_module", train_ppo_ray_that_dies)
    argv = ["--actor.model_name_or_path", str(context["model"]), *LAUNCH_BASE, "--ds.lora.rank", "8"]
    try:
        with pytest.raises(RuntimeError, match="injected"):
            launch.main([*argv, "--ds.lora.target_modules", "q_proj", "v_proj"])
        assert len(left) == 2 and not any(os.path.exists(path) for path in left)
        assert os.path.exists(other_run)
    finally:
        os.unlink(other_run)


@pytest.mark.parametrize(
    "recipe", sorted(p.name for p in render_recipe.RECIPES_DIR.glob("*.yaml") if p.name != "base.yaml")
)
def test_shipped_recipes_target_modules_that_exist(recipe, tiny_model_dir):
    """Each recipe's LoRA targets against its model: a hub id's reference config (memory_budget.py), or
    the tiny checkpoint the CPU recipes build when they run (absent on a fresh clone: the test builds the
    same family). Negative control: a target no Qwen model has."""
    run = render_recipe.load_run(recipe, environ={})
    model = run.args.actor.model_name_or_path
    if "/tiny-" in model:
        model = str(tiny_model_dir(model.rsplit("tiny-", 1)[1]))
    result = preflight.check_lora_config(run, model)
    # Qwen3.5's in_proj_a/in_proj_b project to one value per linear-attention head (32 in the 9B, 48 in
    # the 27B), below the recipes' rank 64: a warning, which these recipes accept.
    assert result.status == preflight.PASS or "above min(in, out)" in result.summary, result
    bad = render_recipe.load_run(recipe, ["ds.lora.target_modules=[c_attn]"], environ={})
    result = preflight.check_lora_config(bad, model)
    assert result.status == preflight.FAIL and "matches no module" in result.summary
