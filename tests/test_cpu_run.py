"""The main job without a GPU: `bash scripts/run_grpo_lora.sh` runs OpenRLHF's real train_ppo_ray on CPU.

Covers: the default CPU job (recipes/learn-cpu.yaml with its control, tools/cpu_run.py -> render_recipe
--exec -> openrlhf_lora_sync.patch.launch -> train_ppo_ray's Ray actors) learning: the synced reward rises
and ends clearly above the stale-engine control, the rollout parity (engine vs trainer log-probs of the
sampled tokens) is near zero when synced and grows on the stale engine; the CPU stand-ins line, full then
delta syncs, skipped syncs in the control, the adapter saved, summary.json / reward.png / the metrics file; a
CPU recipe on a Qwen2.5-VL checkpoint built elsewhere (transformers' save_pretrained with its processor
files), used as given; a missing model path refused in one line; the recipe's own tiny path built.
Does not cover: GPUs; faults in the real loop (test_real_trainer_faults.py); two Ray nodes
(test_two_node.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from openrlhf_lora_sync import QUIET_WARNINGS
from openrlhf_lora_sync.tools import cpu_run

ROOT = Path(__file__).resolve().parents[1]
# test_user_inputs.py's checkpoint builders (transformers' classes, published config fields only), by path:
# the tests are not a package (--import-mode=importlib).
_spec = importlib.util.spec_from_file_location("user_inputs", Path(__file__).with_name("test_user_inputs.py"))
user_inputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(user_inputs)
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
    assert len(summary["history"]) == len(summary["control_history"]) == 12
    # A step's row carries the sync that ended the step before it: the first has none.
    probes = [row[PROBE] for row in summary["history"] if PROBE in row]
    assert len(probes) >= len(summary["history"]) - 2 and max(probes) < 0.1, probes
    assert (out / "adapter_config.json").is_file() and (out / "control" / "adapter_config.json").is_file()
    assert (out / "reward.png").is_file() and (out / cpu_run.METRICS_FILE).is_file()
    assert "mean reward, first 5 -> last 5 steps" in done.stdout and "rollout parity" in done.stdout
    # The offline wandb run (OpenRLHF's WandbLogger in its PPOTrainer actor): OpenRLHF's own metrics and the
    # sync, probe and parity numbers, the same rewards as the metrics file.
    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    rows = [row for row in wandb_history(wandb_run).values() if "train/rollout/reward_mean" in row]
    for key in ("train/policy_loss", "train/sync/bytes", f"train/{PROBE}", "train/parity/gen_kl"):
        assert any(key in row for row in rows), key
    rewards = [row["train/rollout/reward_mean"] for row in rows]
    assert rewards == pytest.approx([row[cpu_run.REWARD_KEY] for row in summary["history"]])


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory):
    """A Qwen2.5-VL as transformers saves it, with its processor files, made without this repo's builders."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    build = user_inputs
    out = build._save(build._qwen2_5_vl(), tmp_path_factory.mktemp("user") / "my-qwen2_5_vl", vlm=True)
    sizes = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        video_processor=Qwen2VLVideoProcessor(**sizes),
        tokenizer=build._tokenizer(),
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
