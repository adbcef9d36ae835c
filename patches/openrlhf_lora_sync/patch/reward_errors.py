"""A reward file's reward_func that raises during a run: a warning, a metric, and a clear stop.

OpenRLHF 0.11.2's SingleTurnAgentExecutor (in each vLLM engine actor) catches what reward_func raises, logs
it at INFO and leaves the sample without a reward; the step then dies in the trainer with "reward_model_group
is required when rewards are not precomputed", and the user's error is nowhere in the log. `install()`
changes that, in every process (openrlhf_patch.apply calls it):
- engine side (SingleTurnAgentExecutor): a raise is logged as a WARNING with its message and its line in
  the reward file (once per distinct error and engine process), the sample scores 0 (rewards and scores),
  and every sample scored by a reward file carries `reward/error_rate` in its extra_logs (1 when its call
  raised, else 0), which OpenRLHF averages into the step's metrics (wandb, metrics/steps.jsonl); the
  error's text travels back with the sample;
- trainer side (SamplesGenerator, in the PPOTrainer actor): the extra_logs names the reward returned for
  some samples of a step and not for those whose call raised are set to 0 for the latter, so every sample
  has the same metrics; a step in which every sample's call raised raises RewardFailed, whose one line
  (the reward file and the step's first error) the launcher prints before exiting with status 1.
Does not cover: HTTP reward servers (upstream retries them and raises), agent functions
(train.agent_func_path), a reward_func that hangs, or rewards that are wrong without raising. Before the
run, config/reward_check.py calls the file on stand-in completions.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from pathlib import Path

from openrlhf_lora_sync.config.reward_check import describe, where

logger = logging.getLogger("openrlhf_lora_sync")

ERROR_RATE_KEY = "reward/error_rate"  # per sample 0 or 1; OpenRLHF's step metric is the mean
ERROR_TEXT_KEY = "lora_sync_reward_error"  # in the executor's output: the error's one line, to the trainer
# What the current sample's reward_func call raised: set by the fetch wrapper, read by the execute wrapper
# (one asyncio task per sample, which awaits the fetch directly, so both see the same context).
_call_error: contextvars.ContextVar[str | None] = contextvars.ContextVar("reward_call_error", default=None)
_warned: set[str] = set()  # errors this process has warned about (type and place, not message)


class RewardFailed(RuntimeError):
    """No sample of a rollout step got a reward: every reward_func call raised."""


def _warning_once(path: str, error: BaseException, text: str) -> None:
    key = f"{type(error).__name__} {where(error, Path(path).resolve())}"
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(
        "reward: %s: reward_func raised %s; the sample scores 0 and counts in %s (an error raised at the "
        "same place again is not repeated here)",
        path,
        text,
        ERROR_RATE_KEY,
    )


def _scoring_raises_as_zero(upstream_fetch):
    """SingleTurnAgentExecutor._fetch_rewards_via_func: a raise becomes reward 0, a warning, and the
    error's line for the sample (_call_error)."""

    @functools.wraps(upstream_fetch)
    async def _fetch_rewards_via_func(self, queries_list, prompts_list, labels_list):
        try:
            return await upstream_fetch(self, queries_list, prompts_list, labels_list)
        except Exception as error:
            path = self.reward_endpoints[0]
            text = describe(error, Path(path).resolve())
            _warning_once(path, error, text)
            _call_error.set(f"{path}: reward_func raised {text}")
            return [{"rewards": 0.0, "scores": 0.0, "extra_logs": {}} for _ in queries_list]

    return _fetch_rewards_via_func


def _marking_errors(upstream_execute):
    """SingleTurnAgentExecutor.execute: each sample scored by a reward file carries ERROR_RATE_KEY in its
    extra_logs, and the error's line under ERROR_TEXT_KEY when its call raised."""

    @functools.wraps(upstream_execute)
    async def execute(self, *args, **kwargs):
        _call_error.set(None)
        output = await upstream_execute(self, *args, **kwargs)
        if self.reward_func is not None:
            error = _call_error.get()
            output["extra_logs"] = {**(output.get("extra_logs") or {}), ERROR_RATE_KEY: float(bool(error))}
            if error:
                output[ERROR_TEXT_KEY] = error
        return output

    return execute


def _keeping_first_error(upstream_process):
    """SamplesGenerator._process_response_into_experience, remembering the first reward error since the
    last step was handed out."""

    @functools.wraps(upstream_process)
    def _process_response_into_experience(self, response, **generate_kwargs):
        if response.get(ERROR_TEXT_KEY) and not getattr(self, "_lora_sync_reward_error", None):
            self._lora_sync_reward_error = response[ERROR_TEXT_KEY]
        return upstream_process(self, response, **generate_kwargs)

    return _process_response_into_experience


def check_step(experiences, first_error: str | None) -> None:
    """Fills the extra_logs names some samples of a step lack with 0 (their reward_func raised); raises
    RewardFailed when no sample of the step got a reward."""
    import torch

    flags = [experience.info.get(ERROR_RATE_KEY) for experience in experiences]
    if experiences and all(flag is not None and float(flag[0]) == 1.0 for flag in flags):
        raise RewardFailed(
            f"the run stopped: no sample of this rollout step got a reward: reward_func raised on all "
            f"{len(experiences)}; the first error: {first_error}; fix the reward file and rerun "
            "(python -m openrlhf_lora_sync.config.reward_check --recipe R checks it without a run)"
        )
    names = {name for experience in experiences for name in experience.info}
    for experience in experiences:
        for name in names - experience.info.keys():
            experience.info[name] = torch.zeros(1)


def _checking_each_step(upstream_generate):
    """SamplesGenerator.generate_samples: check_step on the samples of the step it hands out."""

    @functools.wraps(upstream_generate)
    def generate_samples(self, **generate_kwargs):
        experiences, *rest = upstream_generate(self, **generate_kwargs)
        first_error, self._lora_sync_reward_error = getattr(self, "_lora_sync_reward_error", None), None
        check_step(experiences, first_error)
        return (experiences, *rest)

    return generate_samples


def failure_line(error: BaseException) -> str | None:
    """RewardFailed's line when `error` (a Ray error from the trainer, or what it wraps) carries one."""
    from openrlhf_lora_sync.patch.run_errors import chain

    for current in chain(error):
        if isinstance(current, RewardFailed):
            return str(getattr(current, "cause", None) or current)  # Ray's wrapper: its cause's text
    return None


def install() -> None:
    """Patch OpenRLHF's executor and samples generator in this process (apply() runs it once)."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    executor = SingleTurnAgentExecutor
    executor._fetch_rewards_via_func = _scoring_raises_as_zero(executor._fetch_rewards_via_func)
    executor.execute = _marking_errors(executor.execute)
    SamplesGenerator._process_response_into_experience = _keeping_first_error(
        SamplesGenerator._process_response_into_experience
    )
    SamplesGenerator.generate_samples = _checking_each_step(SamplesGenerator.generate_samples)
