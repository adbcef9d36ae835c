"""The main job without a GPU: `bash scripts/run_grpo_lora.sh` runs OpenRLHF's real train_ppo_ray on CPU.

Covers: the default CPU job (recipes/learn-cpu.yaml with its control, tools/cpu_run.py -> render_recipe
--exec -> openrlhf_lora_sync.patch.launch -> train_ppo_ray's Ray actors) learning: the synced reward rises
and ends clearly above the stale-engine control, the rollout parity (engine vs trainer log-probs of the
sampled tokens) is near zero when synced and grows on the stale engine; the CPU stand-ins line, full then
delta syncs, skipped syncs in the control, the adapter saved, summary.json / reward.png / the metrics file,
which holds every key scripts/wandb_workspace.py's panels plot (but the math reward's: not this run's); a
CPU recipe on a Qwen2.5-VL checkpoint built elsewhere (transformers' save_pretrained with its processor
files), used as given; a missing model path refused in one line; the recipe's own tiny path built.
Does not cover: GPUs; faults in the real loop (test_real_trainer_faults.py); two Ray nodes
(test_two_node.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openrlhf_lora_sync import QUIET_WARNINGS
from openrlhf_lora_sync.config.recipe import load_recipe
from openrlhf_lora_sync.patch import launch
from openrlhf_lora_sync.testing import user_checkpoints
from openrlhf_lora_sync.tools import cpu_run, wandb_workspace

from rewards.math_answer import reward_func

ROOT = Path(__file__).resolve().parents[2]
# Measured (2026-12-04, 2 shared cores, 12 steps, train_ppo_ray): synced 0.42 -> 0.71, mean gen-KL 3e-5
# (max 1.3e-4); the stale-engine control's gen-KL grows to ~1-3 by step 12. The margins sit inside those gaps.
MIN_RISE = 0.1
MIN_ABOVE_CONTROL = 0.1
PROBE = "sync/probe_max_abs_diff"


def no_gpu_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine without a GPU, whatever this host has: nvidia-smi lists none."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("WANDB_DIR", None)  # the launcher's default: wandb's files in the run folder
    return env


def run_script(tmp_path: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_grpo_lora.sh"), *args],
        capture_output=True, text=True, env=no_gpu_env(tmp_path), timeout=timeout, cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def learn_run(tmp_path_factory):
    """`bash scripts/run_grpo_lora.sh` with no recipe, its outputs in a temporary folder."""
    tmp = tmp_path_factory.mktemp("learn-cpu")
    out = tmp / "out"
    done = run_script(
        tmp,
        f"actor.model_name_or_path={tmp / 'model' / 'tiny-qwen2_5_vl'}",  # its own tiny path: built
        f"ckpt.output_dir={out}",
        f"ckpt.path={out / 'checkpoints'}",
    )
    return done, out


@pytest.mark.slow
def test_the_main_job_is_openrlhfs_trainer_and_learns_above_its_control(learn_run, wandb_history):
    done, out = learn_run
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "no recipe given and no GPU" in done.stderr and "learn-cpu.yaml" in done.stderr
    for actor in ("PPOTrainer", "PolicyModelActor", "RolloutRayActor"):  # OpenRLHF's Ray actors ran
        assert f"({actor} pid=" in log
    assert "no CUDA: CPU stand-ins in every process" in log
    assert "building the tiny random qwen2_5_vl checkpoint" in log
    assert "weight sync: full (first sync)" in log and "weight sync: delta" in log
    assert "weight sync: skipped (sync.stale_engine_control" in log  # the control's engine stays stale
    # Third-party warnings that ask nothing of the user: silenced in every process, vLLM's included (a
    # warning line shows its message, and the file of the module it is attributed to).
    for message, _, module in QUIET_WARNINGS:
        assert (message or module.replace(".", "/") + ".py:") not in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"]
    assert summary["reward_last"] - summary["reward_first"] > MIN_RISE
    assert summary["reward_last"] - summary["control_reward_last"] > MIN_ABOVE_CONTROL
    assert summary["control_reward_last"] - summary["control_reward_first"] < MIN_RISE
    # Rollout parity: the synced engine samples what the trainer computes; the stale one drifts away.
    assert summary["parity"]["gen_kl_max"] < 1e-2
    assert summary["control_parity"]["gen_kl_mean"] > 5 * summary["parity"]["gen_kl_mean"]
    history, control = summary["history"], summary["control_history"]
    assert len(history) == len(control) == 12 >= 2 * cpu_run.REWARD_WINDOW  # first and last windows apart
    # Both runs start from the untrained model, which writes some ASCII among its byte noise.
    assert all(0 < run[0][cpu_run.REWARD_KEY] < 0.6 for run in (history, control)), (history[0], control[0])
    # The first sync (ending step 1) is full, every later one a delta; the control's engine gets the first.
    assert [row.get("sync/full") for row in history] == [None, 1] + [0] * (len(history) - 2)
    assert [row.get("sync/full") for row in control] == [None, 1] + [None] * (len(control) - 2)
    # A step's row carries the sync that ended the step before it: the first has none.
    probes = [row[PROBE] for row in summary["history"] if PROBE in row]
    assert len(probes) >= len(summary["history"]) - 2 and max(probes) < 0.1, probes
    # The probe's floor, measured once before the first sync, and every probe's verdict against it.
    assert "post-sync probe: 24 tokens, floor max" in log
    verdicts = [row["sync/probe_verdict"] for row in summary["history"] if "sync/probe_verdict" in row]
    assert len(verdicts) == len(probes) and set(verdicts) == {0}, verdicts
    assert summary["parity"]["gen_kl_over_gate_steps"] == 0  # no gen-KL warning on a synced run
    assert (out / "adapter_config.json").is_file() and (out / "control" / "adapter_config.json").is_file()
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / cpu_run.METRICS_FILE).is_file()
    # The adapter as peft saves it, on the recipe's targets; peft starts B at 0, so a non-zero B was trained.
    assert_peft_adapter(out, load_recipe(ROOT / "recipes" / "learn-cpu.yaml")["ds.lora.target_modules"])
    lora_b = [w for name, w in adapter_weights(out).items() if "lora_B" in name]
    assert lora_b and all(w.abs().max() > 0 for w in lora_b)
    assert "mean reward, first 5 -> last 5 steps" in done.stdout and "rollout parity" in done.stdout
    # The offline wandb run (OpenRLHF's WandbLogger in its PPOTrainer actor): OpenRLHF's own metrics and the
    # sync, probe and parity numbers, the same rewards as the metrics file.
    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    rows = [row for row in wandb_history(wandb_run).values() if "train/rollout/reward_mean" in row]
    logged = ("train/policy_loss", "train/sync/bytes", f"train/{PROBE}", "train/parity/gen_kl")
    for key in (*logged, "train/ascii_fraction"):  # the last: the reward file's extra_logs
        assert any(key in row for row in rows), key
    for run_dir, steps in ((out, history), (out / cpu_run.CONTROL, control)):  # each run its own wandb run
        (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
        rows = [row for row in wandb_history(wandb_run).values() if "train/rollout/reward_mean" in row]
        rewards = [row["train/rollout/reward_mean"] for row in rows]
        assert rewards == pytest.approx([row[cpu_run.REWARD_KEY] for row in steps]), run_dir


def adapter_weights(out: Path) -> dict:
    """The adapter's tensors as peft loads them (adapter_model.safetensors or .bin), by name."""
    from peft.utils import load_peft_weights

    return load_peft_weights(str(out), device="cpu")


def assert_peft_adapter(out: Path, targets: list[str]) -> None:
    """The run's adapter in peft's format (what export_merged and vLLM load): a LoRA on `targets` (the
    recipe's), lora_A / lora_B tensors and none in the vision tower. A targeted lm_head also has its own
    frozen weight saved (peft's save_embedding_layers="auto" for lm_head): nothing else is."""
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(out)
    assert config.peft_type == "LORA" and set(config.target_modules) == set(targets), config.target_modules
    names = list(adapter_weights(out))
    lora = [name for name in names if name.split(".")[-2] in ("lora_A", "lora_B")]
    others = [name for name in names if name not in lora]
    assert lora and all(name.endswith(".lm_head.base_layer.weight") for name in others), names
    assert ("lm_head" in targets) == bool(others), names
    assert not [name for name in names if "visual" in name.split(".")], names


def panel_keys_nothing_logs(logged: set[str]) -> set[str]:
    """The keys scripts/wandb_workspace.py's panels plot that are not in `logged` (wandb names: OpenRLHF
    logs its training status, the sync's and parity's numbers among it, under train/) nor among the math
    reward's extra_logs, which the GPU recipes log (the CPU run's reward is another)."""
    reward_keys = {f"train/{key}" for key in reward_func(["q"], ["p"], ["1"])["extra_logs"]}
    workspace = wandb_workspace.build_workspace("entity", "project", "GRPO LoRA")
    plotted = {key for section in workspace.sections for panel in section.panels for key in panel.y}
    return plotted - logged - reward_keys


@pytest.mark.slow
def test_the_wandb_workspace_plots_keys_the_real_run_logs(learn_run):
    done, out = learn_run
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [json.loads(line) for line in (out / cpu_run.METRICS_FILE).read_text().splitlines()]
    logged = {f"train/{key}" for row in rows for key in row}
    assert not panel_keys_nothing_logs(logged), sorted(panel_keys_nothing_logs(logged))
    # Negative control: OpenRLHF renaming a metric the panels plot is caught.
    assert panel_keys_nothing_logs(logged - {"train/policy_loss"}) == {"train/policy_loss"}


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory):
    """A Qwen2.5-VL as transformers saves it, with its processor files (testing/user_checkpoints.py: not
    tiny_models.py)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    build = user_checkpoints
    out = build.save_model(
        build.qwen2_5_vl_config(), tmp_path_factory.mktemp("user") / "my-qwen2_5_vl", vlm=True
    )
    sizes = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        video_processor=Qwen2VLVideoProcessor(**sizes),
        tokenizer=build.qwen_tokenizer(),
        chat_template=build.CHAT_TEMPLATE,
    ).save_pretrained(out)
    return out


@pytest.mark.slow
def test_a_cpu_recipe_runs_on_a_checkpoint_built_elsewhere(user_checkpoint, tmp_path):
    out = tmp_path / "out"
    done = run_script(
        tmp_path,
        "smoke-cpu",
        f"actor.model_name_or_path={user_checkpoint}",
        "data.max_samples=2",  # one step
        "data.max_len=256",  # its max_position_embeddings: 512 is refused (test_config_checks.py)
        f"ckpt.output_dir={out}",
        f"ckpt.path={out / 'checkpoints'}",
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "building the tiny" not in log
    assert f"model='{user_checkpoint}'" in log  # the engine loaded the user's checkpoint, as given
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == str(user_checkpoint) and len(summary["history"]) == 1
    # smoke-cpu adapts the language linears by name; the vision tower's MLPs share the bare names.
    targets = load_recipe(ROOT / "recipes" / "smoke-cpu.yaml")["ds.lora.target_modules"]
    assert_peft_adapter(out, targets)
    assert any(".layers." in name for name in adapter_weights(out))


def test_a_model_path_that_is_neither_a_checkpoint_nor_the_recipes_tiny_path_is_refused(tmp_path, capsys):
    missing = tmp_path / "my-model"
    assert cpu_run.main(["smoke-cpu", "--set", f"actor.model_name_or_path={missing}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"cpu_run: actor.model_name_or_path: {missing} is not a local checkpoint")


@pytest.mark.parametrize(
    ("model", "family"),
    [
        ("outputs/learn-cpu/tiny-qwen2_5_vl", "qwen2_5_vl"),  # the recipes' own tiny path
        ("/data/tiny-qwen3_vl", "qwen3_vl"),  # any folder named after a tiny family
        ("/data/tiny-llama", None),  # not a tiny family: used as given
        ("Qwen/Qwen2.5-VL-3B-Instruct", None),
    ],
)
def test_tiny_family(model, family):
    assert cpu_run.tiny_family(model) == family


def earlier_runs_outputs(out: Path) -> None:
    """What a successful earlier run left in the folder: 12 steps of rising reward, its summary and plot."""
    for run_dir in (out, out / cpu_run.CONTROL):
        rows = [{"global_step": step, cpu_run.REWARD_KEY: 0.4 + step / 40} for step in range(1, 13)]
        (run_dir / cpu_run.METRICS_FILE).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / cpu_run.METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "summary.json").write_text(json.dumps({"ok": True, "reward_first": 0.45}))
    (out / "reward.png").write_bytes(b"an earlier plot")


@pytest.mark.parametrize("control_status", [1, 0], ids=["control_fails", "both_succeed"])
def test_a_run_reports_only_its_own_steps(control_status, tmp_path, monkeypatch, capsys):
    """An earlier run's outputs are in the folder. When this run's control fails (the synced run never
    starts), nothing of the earlier run is shown: one FAIL line, no table, no plot, summary.json ok false.
    The control (both succeed) shows this run's two steps only. The trainer runs are stood in for: their
    exit status and the metrics they log are this test's input (a real failing run:
    test_reward_errors.py; a real successful one: the tests above)."""
    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    (model / "config.json").write_text("{}")
    earlier_runs_outputs(out)

    def trainer(recipe_path, sets):
        run_dir = Path([s for s in sets if s.startswith("ckpt.output_dir=")][-1].partition("=")[2])
        status = control_status if run_dir.name == cpu_run.CONTROL else 0
        if status == 0:  # what the patched trainer writes: one row per logged step
            rows = [{"global_step": step, cpu_run.REWARD_KEY: 0.111} for step in (1, 2)]
            (run_dir / cpu_run.METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
        return status

    monkeypatch.setattr(cpu_run, "run_trainer", trainer)
    sets = [f"actor.model_name_or_path={model}", f"ckpt.output_dir={out}", f"ckpt.path={out / 'ckpt'}"]
    code = cpu_run.main(["smoke-cpu", "--control", *[a for s in sets for a in ("--set", s)]])
    shown = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    if control_status:
        assert code == 1 and summary["ok"] is False and summary["failed"] == cpu_run.CONTROL
        assert summary["history"] == summary["control_history"] == []
        assert shown.out == "" and not (out / "reward.png").exists()
        (line,) = [line for line in shown.err.splitlines() if line.startswith("cpu_run: FAIL")]
        assert "the control exited with status 1" in line and "no results" in line
        return
    assert code == 0 and summary["ok"] and len(summary["history"]) == len(summary["control_history"]) == 2
    table = shown.out.strip().split("\n\n")[0].splitlines()
    assert len(table) == 3 and all("0.111" in row for row in table[1:]), shown.out  # header + 2 steps
    assert (out / "reward.png").read_bytes() != b"an earlier plot"


def env_with_a_listed_gpu(tmp_path: Path) -> dict[str, str]:
    """A machine whose nvidia-smi lists a GPU (the CPU stack installed all the same)."""
    env = no_gpu_env(tmp_path)
    listing = "GPU 0: NVIDIA GeForce RTX 4090 (UUID: x)"
    (tmp_path / "bin" / "nvidia-smi").write_text(f"#!/bin/sh\necho '{listing}'\n")
    return env


@pytest.mark.parametrize(
    ("visible", "recipe"),
    [("", "learn-cpu.yaml"), (None, "qwen2_5_vl-7b-4x4090.yaml"), ("0", "qwen2_5_vl-7b-4x4090.yaml")],
    ids=["hidden", "unset_control", "one_gpu_control"],
)
def test_an_empty_cuda_visible_devices_picks_the_cpu_job(visible, recipe, tmp_path):
    env = env_with_a_listed_gpu(tmp_path)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_grpo_lora.sh"), "--dry-run"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0 and recipe in done.stderr.splitlines()[0], done.stderr[-2000:]


@pytest.mark.parametrize(
    ("value", "hidden"), [("", True), (" ", True), (None, False), ("0", False), ("0,1", False)]
)
def test_gpus_hidden_by_an_empty_list(value, hidden):
    environ = {} if value is None else {launch.VISIBLE_DEVICES_ENV: value}
    assert launch.gpus_hidden_by_empty_list(environ) is hidden


def test_ray_itself_refuses_gpus_declared_under_an_empty_list(tmp_path):
    """Why the launcher drops the variable on a CPU run: Ray's own refusal, reproduced (the control for
    the run below, which gets past it)."""
    env = {**no_gpu_env(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    script = "import ray; ray.init(address='local', num_gpus=1, include_dashboard=False)"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode != 0
    assert "Attempting to start raylet with 1 GPU, but CUDA_VISIBLE_DEVICES contains []" in done.stderr


@pytest.mark.slow
def test_the_cpu_job_runs_with_gpus_hidden_by_an_empty_list(tmp_path):
    out = tmp_path / "out"
    env = {**no_gpu_env(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_grpo_lora.sh"), "smoke-cpu", "data.max_samples=2",
         f"actor.model_name_or_path={tmp_path / 'model' / 'tiny-qwen2_5_vl'}",
         f"ckpt.output_dir={out}", f"ckpt.path={out / 'checkpoints'}"],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "Attempting to start raylet" not in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and len(summary["history"]) == 1
