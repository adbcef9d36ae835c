"""The CPU learning run (recipes/learn-cpu.yaml through scripts/smoke_cpu.py --control) and its reward.

Covers: rewards/ascii_fraction.py, loaded by OpenRLHF's own executor, on every row of its docstring's
table; the learning run as the recipe has it (STEPS, from its keys: this driver cycles the data rows up
to data.max_samples, 16 steps; OpenRLHF's trainer takes the 6 rows once an episode, 12 steps,
tests/test_cpu_run.py): the synced run's mean reward over its last 5 steps beats its first 5 by
LEARNING_MARGIN while the control's (same seeds and data, engine never synced
after step 0) does not; both runs start from the same samples; the control's engine really is stale and
the synced one is not; summary.json, the offline wandb run and reward.png hold both curves. This is the
in-process driver (a fast test helper); the main job, OpenRLHF's real trainer, is tests/test_cpu_run.py.
Does not cover: its time (measured by hand, see scripts/smoke_cpu.py), GPUs, Ray.

Seeded: the tiny model (conftest, seed 0), the LoRA init and every rollout sample (--seed 0) are fixed, so
the run is the same each time on a given machine; other seeds are measured in scripts/smoke_cpu.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from openrlhf_lora_sync.config.recipe import load_recipe
from openrlhf_lora_sync.tools import smoke_cpu

from rewards import REWARDS, ascii_fraction, reward_file

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "learn-cpu.yaml"
FLAGS = load_recipe(RECIPE)
# The driver's steps: each of train.num_episodes cycles the data rows up to data.max_samples,
# rollout.batch_size prompts a step.
STEPS = math.ceil(FLAGS["data.max_samples"] / FLAGS["rollout.batch_size"]) * FLAGS["train.num_episodes"]
# First-5 to last-5 means, seeds 0-3 (scripts/smoke_cpu.py): the synced run +0.28 to +0.42 (from about 40%
# ASCII to all of it; the rise starts within the first 5 steps), the control -0.02 to +0.01 (sampling noise
# around its initial rate).
LEARNING_MARGIN = 0.15
PROMPT = (
    "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>Find x.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


# --------------------------------------------------------------------------------------------- reward


@pytest.fixture(scope="module")
def reward_func():
    """The reward as OpenRLHF 0.11.2 loads it for --reward.remote_url."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    return SingleTurnAgentExecutor(remote_rm_url=str(reward_file("ascii_fraction"))).reward_func


@pytest.mark.parametrize(
    ("response", "reward", "no_response"),
    [
        ("Find x = 12.", 1.0, 0),
        ("a\tb\n", 1.0, 0),
        ("ab\x00\x7f", 0.5, 0),
        ("ab\ufffd\ufffd", 0.5, 0),
        ("\u00e9a", 0.5, 0),
        ("\uff11a", 0.5, 0),  # a full-width digit
        ("\u00bda", 0.5, 0),
        ("a<|image_pad|>\x00<|endoftext|>", 0.5, 0),
        ("ab<|im_end|>\n\x00\x00", 1.0, 0),
        ("", 0.0, 1),
        ("<|endoftext|><|im_end|>", 0.0, 1),
    ],
)
def test_reward_rows(reward_func, response, reward, no_response):
    result = reward_func([PROMPT + response], [PROMPT], ["5"])
    assert result["rewards"].tolist() == pytest.approx([reward])
    assert result["scores"].tolist() == pytest.approx([reward])
    assert result["extra_logs"] == pytest.approx({"ascii_fraction": reward, "ascii_no_response": no_response})


@pytest.mark.parametrize("query", [None, b"<|im_start|>assistant\nab", 12, "user text without a turn"])
def test_reward_without_a_response_is_zero(reward_func, query):
    result = reward_func([query], ["<|im_start|>user\nq<|im_end|>\n"], [None])
    assert result["rewards"].tolist() == [0.0]
    assert result["extra_logs"]["ascii_no_response"] == 1.0


def test_reward_falls_back_to_the_prompt_prefix_and_averages_its_logs(reward_func):
    plain_prompt = "Q: find x. A: "
    result = reward_func([plain_prompt + "ab\x00\x00", PROMPT + "7"], [plain_prompt, PROMPT], [None, None])
    assert result["rewards"].tolist() == pytest.approx([0.5, 1.0])
    assert result["extra_logs"] == pytest.approx({"ascii_fraction": 0.75, "ascii_no_response": 0.0})
    assert reward_func([], [], [])["rewards"].tolist() == []


def test_registry_names_the_reward_file():
    assert REWARDS["ascii_fraction"] is ascii_fraction.reward_func
    assert reward_file("ascii_fraction") == ROOT / "rewards" / "ascii_fraction.py"


# ------------------------------------------------------------------------------------- learning run


@pytest.fixture(scope="module")
def learn_run(smoke_cpu_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("learn-cpu")
    exit_code, summary, wandb_rows = smoke_cpu_run(out, "--recipe", str(RECIPE), "--control", "--seed", "0")
    return SimpleNamespace(
        exit_code=exit_code, out=out, summary=summary, history=summary["history"], wandb_rows=wandb_rows
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_synced_run_learns_and_the_control_does_not(learn_run):
    assert learn_run.exit_code == 0, learn_run.summary["failure"]
    summary, history = learn_run.summary, learn_run.history
    rewards = [row["reward/mean"] for row in history[1:]]
    control = [row["control/reward/mean"] for row in history[1:]]
    assert len(rewards) == len(control) == STEPS
    assert summary["reward_first"] == pytest.approx(mean(rewards[:5]))
    assert summary["reward_last"] == pytest.approx(mean(rewards[-5:]))
    assert summary["control_reward_first"] == pytest.approx(mean(control[:5]))
    assert summary["control_reward_last"] == pytest.approx(mean(control[-5:]))
    # Same seeds, same data, same initial policy on the engine: the first step's samples are the same.
    assert rewards[0] == control[0]
    assert 0 < rewards[0] < 0.6  # the untrained model writes some ASCII, mostly byte noise
    assert summary["reward_last"] - summary["reward_first"] > LEARNING_MARGIN, rewards
    assert summary["control_reward_last"] - summary["control_reward_first"] < LEARNING_MARGIN, control


@pytest.mark.slow
def test_only_the_control_samples_from_a_stale_engine(learn_run):
    tolerance = learn_run.summary["tolerance"]
    history = learn_run.history
    key = "rollout/engine_vs_policy_logprob_max_abs_diff"
    assert all(row[key] <= tolerance for row in history[1:])
    assert all(row["sync/probe_max_abs_diff"] <= tolerance for row in history)
    # The control trains too, but its engine keeps step 0's policy: from step 2 on its samples' engine
    # log-probs are far from the policy's.
    assert history[1][f"control/{key}"] <= tolerance
    assert all(row[f"control/{key}"] > 100 * tolerance for row in history[2:])
    assert [row.get("control/sync/full") for row in history] == [1] + [None] * STEPS


@pytest.mark.slow
def test_wandb_and_the_plot_hold_both_curves(learn_run):
    rows = learn_run.wandb_rows
    assert sorted(rows) == list(range(STEPS + 1))
    for logged in learn_run.history[1:]:
        for key in ("reward/mean", "control/reward/mean"):
            assert rows[logged["step"]][key] == pytest.approx(logged[key]), key
    plot = learn_run.out / "reward.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not plot.exists()
        pytest.skip("matplotlib is not installed: the run draws no plot")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_recipe_runs_the_full_learning_run(tmp_path):
    smoke = smoke_cpu.smoke_run(smoke_cpu.parse_args(["--recipe", str(RECIPE), "--control"]))
    assert smoke.control and smoke.reward_file == reward_file("ascii_fraction")
    assert smoke.steps == STEPS >= 2 * smoke_cpu.REWARD_WINDOW
    assert smoke.args.rollout.batch_size == FLAGS["rollout.batch_size"]
    assert smoke.args.ds.lora.target_modules == ["lm_head"]
