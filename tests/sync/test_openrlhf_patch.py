"""The patch applied to the installed OpenRLHF: idempotence, version refusal, Ray workers, and the
patched `ActorPPOTrainer.broadcast_to_vllm` itself syncing a LoRA policy into a real vLLM engine actor.

The engine test runs OpenRLHF's own `RolloutRayActor` (vLLM's AsyncLLM with V1 multiprocessing, so the
engine core is a separate, non-Ray process that loads the worker extension by import name) on CPU,
and calls the patched method (not a copy) with the trainer's attributes it reads.
It runs once per transport: colocated engines get /dev/shm buckets (sync.transport auto), and with
LORA_SYNC_TRANSPORT=broadcast (what auto picks for engines on another Ray node: tests/sync/test_two_node.py)
engines that are not colocated get a broadcast over a process group with the engine workers (gloo here,
NCCL on GPUs).
Does not cover: a whole `train_ppo_ray` run (the CPU smoke issue), CUDA IPC or NCCL (gpu tests).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from openrlhf.trainer import ppo_trainer
from openrlhf.trainer.ray import ppo_actor, vllm_engine
from openrlhf_lora_sync.base import pins
from openrlhf_lora_sync.patch import openrlhf_patch
from openrlhf_lora_sync.patch.launch import ray_runtime_env
from openrlhf_lora_sync.testing.logprob_check import LOGPROB_TOLERANCE


def _patched_state():
    return ppo_actor.ActorPPOTrainer.broadcast_to_vllm, vllm_engine.RolloutRayActor


def test_apply_is_idempotent():
    openrlhf_patch.apply()
    first = _patched_state()
    openrlhf_patch.apply()
    assert _patched_state() == first
    assert ppo_actor.ActorPPOTrainer.broadcast_to_vllm is openrlhf_patch.lora_broadcast_to_vllm
    fit = ppo_trainer.PPOTrainer.__ray_metadata__.modified_class.fit  # part sleep2_first_rollout
    assert fit.__qualname__.startswith("_synced_before_first_rollout")
    assert openrlhf_patch.is_applied()


def test_apply_refuses_an_openrlhf_outside_the_supported_range(monkeypatch):
    """apply() checks before it patches (the ranges themselves: tests/unit/test_supported_versions.py)."""
    found = {**pins.installed_versions(), "openrlhf": "0.10.4"}
    monkeypatch.setattr(pins, "installed_versions", lambda: found)
    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, openrlhf_patch._APPLIED_MARK, False, raising=False)
    with pytest.raises(pins.UnsupportedVersionError, match="OpenRLHF 0.10.4 is outside >=0.11.0"):
        openrlhf_patch.apply()


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, runtime_env=ray_runtime_env(), log_to_driver=False)
    yield ray
    ray.shutdown()


def test_patch_reaches_ray_tasks_actors_and_nested_tasks(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def patched_here() -> bool:
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        return ActorPPOTrainer.broadcast_to_vllm.__name__ == "lora_broadcast_to_vllm"

    @ray.remote(num_cpus=0)
    def nested() -> bool:
        return ray.get(patched_here.remote())

    @ray.remote(num_cpus=0)
    class Probe:
        def patched(self) -> bool:
            return ray.get(patched_here.remote()) and openrlhf_patch.is_applied()

    assert ray.get(patched_here.remote())
    assert ray.get(nested.remote())
    assert ray.get(Probe.remote().patched.remote())


@pytest.fixture(scope="module")
def engine_actor(ray_cluster, tiny_model_dir, rollout_actor):
    """OpenRLHF's own engine actor (patched), on the tiny Qwen2.5-VL, as create_vllm_engines builds it."""
    engine = rollout_actor.start(tiny_model_dir("qwen2_5_vl"))
    assert ray_cluster.get(engine.lora_sync_rpc.remote("packed_modules_mapping"))[0]  # our extension loaded
    return engine


@pytest.mark.parametrize(
    "colocated, transport",
    [
        (True, "shm"),  # colocated engines: /dev/shm buckets (auto)
        (False, "broadcast"),  # engines elsewhere: a process group with the engine workers (gloo on CPU)
    ],
)
def test_patched_broadcast_to_vllm_syncs_a_real_engine_actor(
    colocated, transport, engine_actor, tiny_model_dir, rollout_actor, monkeypatch
):
    from openrlhf_lora_sync.sync.transport import BroadcastTransport

    # auto picks shm for an engine on the trainer's Ray node without CUDA (this host): ask for broadcast.
    monkeypatch.setenv("LORA_SYNC_TRANSPORT", "auto" if transport == "shm" else transport)

    # A different seed per case: the engine holds the previous case's policy, which must not match this one.
    trainer, engine_diff = rollout_actor.trainer_and_check(
        engine_actor, str(tiny_model_dir("qwen2_5_vl")), colocated, seed=int(colocated)
    )
    before = engine_diff()
    ppo_actor.ActorPPOTrainer.broadcast_to_vllm(trainer)  # the patched upstream method
    after = engine_diff()

    assert trainer._lora_sync_last_stats.mode == "full"
    assert trainer._lora_sync_last_stats.transport == transport
    assert isinstance(getattr(trainer, "_lora_sync_broadcast", None), BroadcastTransport) == (
        transport == "broadcast"
    )
    # Measured in-process, these policies on the base: 0.58 (seed 0) and 0.72 (seed 1), over seeds 0-9
    # 0.51-0.83, while correct syncs measured 0.002-0.004: 10 x tolerance (0.5) sat within 2% of the
    # smallest; 5 x tolerance separates them widely.
    assert before > 5 * LOGPROB_TOLERANCE["bfloat16"]
    assert after <= LOGPROB_TOLERANCE["bfloat16"], f"before {before:.3g}, after {after:.3g}"
    ppo_actor.ActorPPOTrainer.broadcast_to_vllm(trainer)
    assert trainer._lora_sync_last_stats.mode == "delta"
    assert engine_diff() <= LOGPROB_TOLERANCE["bfloat16"]


def test_trainer_refuses_dora_when_built(tiny_model_dir):
    from openrlhf_lora_sync.sync.merge import UnsupportedAdapterError
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def upstream_init(self, policy):
        self.actor = SimpleNamespace(model=SimpleNamespace(module=policy))

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"))
    dora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    patched_init = openrlhf_patch._checking_adapters_at_start(upstream_init)
    with pytest.raises(UnsupportedAdapterError, match="DoRA"):
        patched_init(SimpleNamespace(), dora)
    openrlhf_patch.apply()
    assert ppo_actor.ActorPPOTrainer.__init__.__qualname__.startswith("_checking_adapters_at_start")


def test_training_status_carries_the_last_sync_stats():
    from openrlhf_lora_sync.sync.sync import SyncStats

    def upstream_ppo_train(self, kl_ctl):
        return {"policy_loss": 0.5}

    ppo_train = openrlhf_patch._with_sync_metrics(upstream_ppo_train)
    trainer = SimpleNamespace()
    assert ppo_train(trainer, 0.0) == {"policy_loss": 0.5}  # no sync yet: nothing added
    trainer._lora_sync_last_stats = SyncStats("delta", "engine kept its weights", 12, 4096, 2, 0.25)
    status = ppo_train(trainer, 0.0)
    assert status["policy_loss"] == 0.5
    assert status["sync/full"] == 0.0 and status["sync/bytes"] == 4096.0 and status["sync/seconds"] == 0.25
