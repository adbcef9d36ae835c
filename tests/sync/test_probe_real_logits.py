"""The post-sync probe at a real model's logit magnitudes: correct syncs pass against the floor measured on
the run, faults still fail, each reading printed with its ratio to the floor (-s).

A tiny Qwen2.5-VL whose output head is scaled so its logits have a real LLM's spread (std 6, max near 30:
testing/tiny_models.spread_logits), a bf16 engine, and the trainer in fp32 and in bf16. There the fixed
bf16 threshold of the tiny models (0.1 on the max) fails a correct sync: the floor itself reads about that.
Does not cover: OpenRLHF's actors (tests/sync/test_faults.py drives openrlhf_patch's probe step; the CPU run
drives the whole loop) or verify_sync's own verdict (tests/sync/test_verify_sync.py).
"""

from __future__ import annotations

import pytest
import torch
from openrlhf_lora_sync.sync import probe, transport
from openrlhf_lora_sync.sync.merge import iter_effective_checkpoint_tensors, sync_units
from openrlhf_lora_sync.sync.plan import SyncState
from openrlhf_lora_sync.sync.sync import LocalEngines, sync_weights
from openrlhf_lora_sync.testing.policies import ATTENTION_AND_MLP_LINEARS, lora_policy, nudge_adapters

FAMILY = "qwen2_5_vl"
LOGIT_STD = 6.0
ENGINE_DTYPE = "bfloat16"
SMALL_BUCKET = 64 << 10
READINGS: list[tuple[str, str, probe.ProbeResult]] = []


@pytest.fixture(scope="module", autouse=True)
def _print_readings():
    yield
    for label, trainer_dtype, result in READINGS:
        print(
            f"probe (trainer {trainer_dtype:>8}) {label:>24}: max {result.max_abs_diff:.3g}, mean "
            f"{result.mean_abs_diff:.3g}, {result.ratio:.3g}x the floor ({result.floor.max_abs_diff:.3g} / "
            f"{result.floor.mean_abs_diff:.3g}): {result.verdict}, fail line {probe.FAIL_RATIO:g}x"
        )


@pytest.fixture(scope="module")
def real_logits_dir(tmp_path_factory):
    from openrlhf_lora_sync.testing.tiny_models import build_tiny_model

    return build_tiny_model(FAMILY, tmp_path_factory.mktemp("real-logits"), logit_std=LOGIT_STD)


@pytest.fixture(scope="module")
def real_logits_engine(real_logits_dir):
    from openrlhf_lora_sync.testing.logprob_check import start_engine

    return start_engine(str(real_logits_dir), ENGINE_DTYPE)


@pytest.fixture
def run(real_logits_dir, real_logits_engine):
    """run(trainer_dtype) -> (policy, engines, floor): the engine back on the checkpoint, the floor measured
    on it as a run does before its first sync."""
    from openrlhf_lora_sync.testing.logprob_check import restore_checkpoint

    def make(trainer_dtype: str):
        restore_checkpoint(real_logits_engine, real_logits_dir)
        policy = lora_policy(real_logits_dir, ATTENTION_AND_MLP_LINEARS, dtype=trainer_dtype)
        engines = LocalEngines(real_logits_engine)
        return policy, engines, probe.calibrate(policy, engines)

    return make


def reading(policy, engines, floor, trainer_dtype: str, label: str) -> probe.ProbeResult:
    result = probe.run_probe(policy, engines, ENGINE_DTYPE, floor)
    READINGS.append((label, trainer_dtype, result))
    return result


def test_the_checkpoint_has_a_real_models_logit_spread(real_logits_dir):
    from openrlhf_lora_sync.testing.tiny_models import BYTE_VOCAB_SIZE

    policy = lora_policy(real_logits_dir, ATTENTION_AND_MLP_LINEARS)
    token_ids = torch.randint(0, BYTE_VOCAB_SIZE, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), policy.disable_adapter():
        logits = policy(input_ids=token_ids).logits
    assert 5 < logits.std() < 7 and logits.abs().max() > 20


@pytest.mark.parametrize("trainer_dtype", ["float32", "bfloat16"])
def test_correct_syncs_pass_where_the_fixed_threshold_would_stop_the_run(trainer_dtype, run):
    policy, engines, floor = run(trainer_dtype)
    assert floor.source == "checkpoint" and floor.max_abs_diff > 0
    state = SyncState()
    assert sync_weights(policy, engines, state, dtype=torch.bfloat16).mode == "full"
    results = [reading(policy, engines, floor, trainer_dtype, "full sync")]
    for step in range(1, 4):
        nudge_adapters(policy, seed=step, scale=0.01)
        assert sync_weights(policy, engines, state, dtype=torch.bfloat16).mode == "delta"
        results.append(reading(policy, engines, floor, trainer_dtype, f"delta sync {step}"))
    assert all(result.verdict == "ok" for result in results), results
    # The fixed bf16 line of the tiny models, on this model's likely tokens: no margin to speak of.
    fixed = probe.fixed_floor(floor.token_ids, ENGINE_DTYPE)
    worst = max(result.max_abs_diff for result in results)
    print(f"trainer {trainer_dtype}: worst correct max {worst:.3g} vs the fixed line {probe.PROBE_THRESHOLD}")
    assert fixed.max_abs_diff * probe.FAIL_RATIO == probe.PROBE_THRESHOLD[ENGINE_DTYPE]


@pytest.mark.parametrize("trainer_dtype", ["float32", "bfloat16"])
def test_faults_fail_against_the_floor(trainer_dtype, run, training_step, monkeypatch):
    """Stale engine after a training step, a bucket lost from a delta sync, a sync half applied, weights lost
    at sleep level 2 with a delta sent: each fails the probe, and a full resync passes it again."""
    policy, engines, floor = run(trainer_dtype)
    state = SyncState()
    sync_weights(policy, engines, state, dtype=torch.bfloat16)
    assert reading(policy, engines, floor, trainer_dtype, "full sync").ok

    def resync(label: str) -> None:
        state.weights_lost(label)
        assert sync_weights(policy, engines, state, dtype=torch.bfloat16).mode == "full"
        assert reading(policy, engines, floor, trainer_dtype, f"resync after {label}").verdict == "ok"

    training_step(policy, seed=1)
    assert not reading(policy, engines, floor, trainer_dtype, "stale engine").ok
    resync("stale")

    real_send = transport.TRANSPORTS["shm"]
    sent = []

    def lose_first_bucket(rpc, named):
        sent.append(len(named))
        return real_send(None if len(sent) == 1 else rpc, named)

    training_step(policy, seed=2)
    monkeypatch.setitem(transport.TRANSPORTS, "shm", lose_first_bucket)
    sync_weights(policy, engines, state, dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKET)
    monkeypatch.setitem(transport.TRANSPORTS, "shm", real_send)
    assert len(sent) > 1 and not reading(policy, engines, floor, trainer_dtype, "bucket lost, delta").ok
    resync("bucket lost")

    zeros = [
        (name, torch.zeros_like(tensor))
        for _, group in iter_effective_checkpoint_tensors(policy, sync_units(policy), torch.bfloat16)
        for name, tensor in group.items()
    ]
    engines.rpc("load_weights_in_place", zeros)
    assert sync_weights(policy, engines, state, dtype=torch.bfloat16).mode == "delta"  # nobody told it
    assert not reading(policy, engines, floor, trainer_dtype, "sleep-2 weights lost").ok

    def fail_second_bucket(rpc, named):
        sent.append(len(named))
        if len(sent) == 2:
            raise ConnectionError("injected transport error")
        return real_send(rpc, named)

    sent.clear()
    state.weights_lost("sleep level 2")
    monkeypatch.setitem(transport.TRANSPORTS, "shm", fail_second_bucket)
    with pytest.raises(ConnectionError):  # the full resync dies after its first bucket
        sync_weights(policy, engines, state, dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKET)
    monkeypatch.setitem(transport.TRANSPORTS, "shm", real_send)
    assert not reading(policy, engines, floor, trainer_dtype, "half-applied full sync").ok
    resync("half-applied")
