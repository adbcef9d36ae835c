"""What the patched run records and checks around its rollouts, beyond the sync (openrlhf_patch parts).

Covers: the rollouts' sampling parameters (vision placeholders never sampled; the sampled tokens'
log-probs returned), rollout parity (the engine's vs the trainer's log-probs of the sampled tokens,
parity/*) and the gen-KL gate on it, the per-step metrics file in --ckpt.output_dir, and wandb's teardown
at the end of a run. Does not cover: the sync's own numbers (sync/*: sync.SyncStats, the probe).
"""

from __future__ import annotations

import logging

from openrlhf_lora_sync.base import settings

logger = logging.getLogger("openrlhf_lora_sync")


def never_sampled_token_ids(model: str, mm_pad_token_ids) -> list[int]:
    """A VLM's vision placeholder ids (image/video pads, vision start/end), which rollouts must not sample.

    The policy's forward counts the placeholders in prompt + response and expects one image feature per
    image pad: a response with a sampled image pad fails there ("Image features and image tokens do not
    match, tokens: 65, features: 64"). A trained model gives these ids next to no probability; a random one
    (the CPU runs' tiny model) samples them often. Empty for text-only runs (no mm_pad_token_ids)."""
    if not mm_pad_token_ids:
        return []
    from transformers import AutoConfig

    from openrlhf_lora_sync.sync.probe import placeholder_token_ids

    config = AutoConfig.from_pretrained(model, trust_remote_code=True)
    return sorted({*placeholder_token_ids(config), *mm_pad_token_ids})


def rollout_sampling(sampling_params, never_sampled: list[int]) -> None:
    """What the patched engine actor changes in OpenRLHF's rollout SamplingParams, in place: the vision
    placeholders get vLLM's lowest logit bias (never_sampled_token_ids), and the engine returns the sampled
    tokens' log-probs, which the trainer compares with its own old-policy log-probs (rollout_parity).
    vLLM's default log-probs are the raw model's (before temperature and this bias) and OpenRLHF's loss
    ignores them unless its importance-sampling correction is on, so GRPO computes what it did."""
    if never_sampled:
        sampling_params.logit_bias = {
            **(sampling_params.logit_bias or {}),
            **dict.fromkeys(never_sampled, -100.0),
        }
    if sampling_params.logprobs is None:
        sampling_params.logprobs = 1


# In --ckpt.output_dir, one JSON object per logged step. In a folder of its own: the final adapter save
# replaces the output folder's files atomically (checkpoint.py) and carries over only its subfolders.
METRICS_FILE = "metrics/steps.jsonl"


def recording_metrics(upstream_save_logs):
    """BasePPOTrainer.save_logs_and_checkpoints, also appending each logged step's numbers (OpenRLHF's
    train metrics, sync/*, parity/*) to <ckpt.output_dir>/METRICS_FILE, the run's local record: the CPU
    run's summary table, summary.json and reward plot are made from it, with or without wandb."""
    import json
    import os

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        if logs_dict and global_step % self.args.logger.logging_steps == 0:
            record = {"global_step": global_step}
            record.update((k, v) for k, v in logs_dict.items() if isinstance(v, (int, float)))
            path = os.path.join(self.args.ckpt.output_dir, METRICS_FILE)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a") as metrics:
                metrics.write(json.dumps(record) + "\n")
        return upstream_save_logs(self, global_step, logs_dict, client_states)

    return save_logs_and_checkpoints


def rollout_parity(experiences) -> dict[str, float]:
    """How far the engine's log-probs of the tokens it sampled (OpenRLHF's rollout_log_probs) are from
    the trainer's old-policy log-probs of the same tokens (action_log_probs), over every action token of
    a rollout step: parity/gen_kl (the k3 estimate of KL(rollout || trainer), >= 0, the quantity NeMo-RL
    gates LoRA runs on, < 1e-3), parity/prob_ratio_mean (trainer / rollout token probability, ~1) and
    parity/max_abs_logprob_diff. Empty when the rollouts carry no log-probs."""
    import torch

    diffs = []
    for experience in experiences:
        rollout, trainer = experience.rollout_log_probs, experience.action_log_probs
        if rollout is None or trainer is None:
            return {}
        mask = experience.action_mask.bool()
        width = trainer.shape[-1]  # the three are aligned at the sequence's end
        diffs.append((trainer.float() - rollout[..., -width:].float())[mask[..., -width:]])
    if not diffs:
        return {}
    log_ratio = torch.cat(diffs)  # log(pi_trainer / pi_rollout) per sampled token
    return {
        "parity/gen_kl": (log_ratio.exp() - 1 - log_ratio).mean().item(),
        "parity/prob_ratio_mean": log_ratio.exp().mean().item(),
        "parity/max_abs_logprob_diff": log_ratio.abs().max().item(),
    }


def with_rollout_parity(upstream_rollout_stats):
    """BasePPOTrainer._compute_rollout_stats plus rollout_parity, logged with OpenRLHF's rollout/*.
    vLLM's log-probs here are the raw model's (before temperature), so they are compared only when the
    rollout temperature is 1 or OpenRLHF asked vLLM for processed log-probs (its IS correction)."""

    from openrlhf_lora_sync.sync.upstream_versions import is_correction_on

    def _compute_rollout_stats(self, experiences):
        stats = upstream_rollout_stats(self, experiences)
        algo = self.args.algo.advantage
        if self.args.rollout.temperature == 1.0 or is_correction_on(algo):
            stats.update(rollout_parity(experiences))
            self._lora_sync_rollout_steps = getattr(self, "_lora_sync_rollout_steps", 0) + 1
            stats.update(gen_kl_gate(stats, self._lora_sync_rollout_steps, self))
        return stats

    return _compute_rollout_stats


class GenKLGateExceeded(RuntimeError):
    """The engine's rollouts drifted from the trainer's policy past sync.gen_kl_gate, and sync.gen_kl_stop
    asked for the run to end there."""


def gen_kl_gate(parity: dict[str, float], step: int, counter) -> dict[str, float]:
    """sync.gen_kl_gate on a rollout step's parity/gen_kl (NeMo-RL gates its LoRA runs at a mean gen-KL of
    1e-3): above it, a warning naming the step and the numbers, the step counted in parity/gen_kl_over_gate
    (this step: 0 or 1) and parity/gen_kl_over_gate_steps (so far, on `counter`); with sync.gen_kl_stop,
    GenKLGateExceeded. Empty when the step has no parity numbers or the gate is 0 (off)."""
    gate = settings.read("sync.gen_kl_gate")
    if "parity/gen_kl" not in parity or gate <= 0:
        return {}
    over = parity["parity/gen_kl"] > gate
    counter._lora_sync_gen_kl_over = getattr(counter, "_lora_sync_gen_kl_over", 0) + over
    if over:
        message = (
            f"rollout step {step}: mean gen-KL {parity['parity/gen_kl']:.3g} between the engine's and the "
            f"trainer's log-probs of the sampled tokens is above sync.gen_kl_gate {gate:g} (max |log ratio| "
            f"{parity['parity/max_abs_logprob_diff']:.3g}; {counter._lora_sync_gen_kl_over} step(s) so far): "
            "the rollouts come from a policy measurably other than the one trained. Check the post-sync "
            "probe's ratio (sync/probe_ratio); in bf16, sync.mode adapter keeps W + BA off the bf16 grid "
            "(docs/fidelity.md)"
        )
        if settings.read("sync.gen_kl_stop"):
            raise GenKLGateExceeded(message + "; sync.gen_kl_stop ends the run here")
        logger.warning("%s", message)
    return {
        "parity/gen_kl_over_gate": float(over),
        "parity/gen_kl_over_gate_steps": float(counter._lora_sync_gen_kl_over),
    }


def closing_wandb(upstream_close):
    """WandbLogger.close, then wandb.teardown(): finish() can return before wandb's service process has
    written the run, and the PPOTrainer actor is ended by Ray right after fit, which otherwise logs wandb's
    "Connection lost" traceback from its exit handler (seen on CPU runs)."""

    def close(self):
        upstream_close(self)
        self.handle.teardown()

    return close
