"""What the patched trainer adds to OpenRLHF's rollouts, without an engine: the rollout parity numbers
(openrlhf_patch.rollout_parity, on OpenRLHF's own Experience), the gen-KL gate on them (gen_kl_gate), the
vision placeholders kept out of sampling (never_sampled_token_ids on a config shaped like the published
Qwen2.5-VL's, rollout_sampling on vLLM's own SamplingParams).

Does not cover: the real trainer computing them (tests/trainer/test_cpu_run.py: synced runs' gen-KL near
0, the stale-engine control's far above), nor vLLM honouring the logit bias (the same runs: a sampled
image pad fails the policy's forward there).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf_lora_sync.patch.openrlhf_patch import (
    GenKLGateExceeded,
    gen_kl_gate,
    never_sampled_token_ids,
    rollout_parity,
    rollout_sampling,
)


def experience(trainer: list[float], rollout: list[float] | None, mask: list[int]) -> Experience:
    """One sample as OpenRLHF's samples generator and experience maker leave it: rollout log-probs
    (0.0 on prompt positions) and trainer log-probs over the sequence minus its first token."""
    return Experience(
        action_log_probs=torch.tensor([trainer]),
        rollout_log_probs=None if rollout is None else torch.tensor([rollout]),
        action_mask=torch.tensor([mask], dtype=torch.bool),
    )


def test_equal_log_probs_give_zero_gen_kl_and_ratio_one():
    same = experience([0.0, -1.0, -2.0], [0.0, -1.0, -2.0], [0, 1, 1])
    parity = rollout_parity([same])
    assert parity == {
        "parity/gen_kl": 0.0,
        "parity/prob_ratio_mean": 1.0,
        "parity/max_abs_logprob_diff": 0.0,
    }


def test_a_shift_gives_the_k3_estimate_and_prompt_positions_are_left_out():
    """Negative control of the one above: the trainer's log-probs 0.5 above the engine's on every action
    token; the prompt position (mask 0) differs by 9 and must not count."""
    shifted = experience([9.0, -0.5, -1.5], [0.0, -1.0, -2.0], [0, 1, 1])
    parity = rollout_parity([shifted])
    assert parity["parity/gen_kl"] == pytest.approx(math.exp(0.5) - 1 - 0.5)
    assert parity["parity/prob_ratio_mean"] == pytest.approx(math.exp(0.5))
    assert parity["parity/max_abs_logprob_diff"] == pytest.approx(0.5)


def test_tokens_of_all_experiences_are_pooled():
    parity = rollout_parity([experience([-1.0, -1.0], [-1.0, -1.0], [1, 1]), experience([-0.7], [-1.0], [1])])
    log_ratios = torch.tensor([0.0, 0.0, 0.3])
    assert parity["parity/gen_kl"] == pytest.approx((log_ratios.exp() - 1 - log_ratios).mean().item())


def test_rollouts_without_engine_log_probs_report_nothing():
    assert rollout_parity([experience([-1.0], None, [1])]) == {}
    assert rollout_parity([]) == {}


@pytest.fixture
def published_qwen2_5_vl(tmp_path):
    """A Qwen2.5-VL config.json with the published checkpoint's token ids, nothing else of this repo's."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653
    )
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["image_token_id"] == 151655
    return tmp_path


def test_vision_placeholders_are_never_sampled(published_qwen2_5_vl):
    # OpenRLHF passes the processor's image/video pad ids as mm_pad_token_ids for a VLM.
    ids = never_sampled_token_ids(str(published_qwen2_5_vl), [151655, 151656])
    assert ids == [151652, 151653, 151655, 151656]
    # A text-only run has no placeholders: nothing is kept out of sampling.
    assert never_sampled_token_ids(str(published_qwen2_5_vl), None) == []


def test_rollout_sampling_biases_the_placeholders_and_asks_for_log_probs():
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=4, logit_bias={7: 1.5})
    rollout_sampling(params, [151652, 151655])
    assert params.logit_bias == {7: 1.5, 151652: -100.0, 151655: -100.0}  # the user's bias kept
    assert params.logprobs == 1  # the sampled token's log-prob, for the parity numbers
    asked = SamplingParams(max_tokens=4, logprobs=5)
    rollout_sampling(asked, [])
    assert asked.logit_bias is None and asked.logprobs == 5  # what OpenRLHF asked for is kept


def parity(gen_kl: float) -> dict[str, float]:
    return {"parity/gen_kl": gen_kl, "parity/max_abs_logprob_diff": 0.5, "parity/prob_ratio_mean": 1.0}


@pytest.mark.parametrize(
    "env, gen_kls, over_per_step",
    [
        ({}, [1e-4, 2e-3, 5e-4, 3e-3], [0, 1, 0, 1]),  # default gate 1e-3: only the steps above it count
        ({"LORA_SYNC_GEN_KL_GATE": "1e-2"}, [2e-3, 3e-3], [0, 0]),  # a looser gate: nothing to say
        ({"LORA_SYNC_GEN_KL_GATE": "0"}, [5.0], [None]),  # 0 switches the gate off: no metrics at all
    ],
)
def test_gen_kl_gate_warns_and_counts_steps_over_it(env, gen_kls, over_per_step, monkeypatch, caplog):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    counter = type("Trainer", (), {})()
    for step, (gen_kl, over) in enumerate(zip(gen_kls, over_per_step, strict=True), start=1):
        with caplog.at_level("WARNING", logger="openrlhf_lora_sync"):
            caplog.clear()
            metrics = gen_kl_gate(parity(gen_kl), step, counter)
        if over is None:
            assert metrics == {} and not caplog.records
            continue
        assert metrics["parity/gen_kl_over_gate"] == over
        assert metrics["parity/gen_kl_over_gate_steps"] == sum(over_per_step[:step])
        warned = [r.getMessage() for r in caplog.records]
        assert bool(warned) == bool(over) and all(f"rollout step {step}" in m for m in warned)


def test_gen_kl_gate_stops_the_run_only_when_asked(monkeypatch):
    counter = type("Trainer", (), {})()
    assert gen_kl_gate(parity(2e-3), 1, counter)["parity/gen_kl_over_gate"] == 1  # a warning, the run goes on
    monkeypatch.setenv("LORA_SYNC_GEN_KL_STOP", "1")
    assert gen_kl_gate(parity(5e-4), 2, counter)["parity/gen_kl_over_gate"] == 0  # under the gate: nothing
    with pytest.raises(GenKLGateExceeded, match="rollout step 3: mean gen-KL 0.002"):
        gen_kl_gate(parity(2e-3), 3, counter)


def test_steps_without_parity_numbers_are_not_gated():
    assert gen_kl_gate({}, 1, type("Trainer", (), {})()) == {}
