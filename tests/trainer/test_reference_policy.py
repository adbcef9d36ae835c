"""The KL reference from the base (reference_policy.py): the policy with its adapters disabled computes what
OpenRLHF's own reference model does, and train_ppo_ray then starts no reference model.

Covers
- Equality: a worker process (DeepSpeed ZeRO-3 on the CPU accelerator, world size 1, fp32) builds OpenRLHF's
  own `Actor` twice from one tiny checkpoint: the policy with LoRA (as PolicyModelActor builds it: loaded
  under `strategy.get_ds_train_config()`, then OpenRLHF's `strategy.prepare((actor, cfg))`, patched by
  apply(), builds its engine and AdamW) and the reference without (as ReferenceModelActor builds it,
  prepared by `strategy.prepare` with its eval config). After AdamW steps (strategy.backward /
  optimizer_step) have moved the policy, the patched `PolicyModelActor.reference_forward` and upstream's
  `ReferenceModelActor.forward` (both through `Actor.forward` with an action mask, left padding
  included) agree within 1e-6, while the policy's own `forward` differs from the reference by more than
  1e-2 (the control). Also: afterwards the policy computes what it did before (adapters back on), every
  requires_grad flag is as it was, and a further training step still moves the adapters (ZeRO-3's
  gradient hooks survive peft's toggling).
  Run twice: as upstream configures the policy, and with the trainer base offload (offload.py,
  LORA_SYNC_OFFLOAD_PARAMS=1: parameters and optimizer in host memory, the reporter's 27B recipe); where
  the engine keeps them is read from the config DeepSpeed parsed for the engine strategy.prepare built
  (cpu with offload, none without), so a broken wrapper in offload.py fails the offload case.
- train_ppo_ray's set-up: upstream `train(args)` (module run as the launcher runs it, after apply(), with
  args from OpenRLHF's own parser through render_recipe's dry run) on a local Ray cluster that declares
  GPU resources the CPU actors never touch. With the mode on no ReferenceModelActor group is created,
  and OpenRLHF's RemoteExperienceMaker, built by BasePPOTrainer from what train() passed, gets
  base_action_log_probs from the real PolicyModelActor Ray actor: equal to the base model's, unlike
  the policy's. With the mode off (the control) train() creates upstream's reference group.
- The setting: default on, 0 off, rank 0 ignored, a bad value refused; a model without LoRA refused.

Stand-ins, and why: CPU torch has no CUDA, so where OpenRLHF's actor code asks for the CUDA device the
workers answer "cpu" (torch.cuda.current_device) and synchronize is a no-op. OpenRLHF's PPOTrainer is
replaced by a BasePPOTrainer without its dataset and vLLM sampler (not what is tested), named so the test
can reach it; train() is stopped where it would load the models (`async_init_model_from_pretrained`,
which needs CUDA), and the policy actor gets its model (OpenRLHF's Actor with LoRA, bf16, no DeepSpeed)
through Ray's `__ray_call__`. OpenRLHF's dtype table has no fp32; the worker adds it.

Does not cover: GPUs, vLLM sleep/wake around the reference forward (the order is upstream's; see the
module docstring), ring attention or tensor-parallel duplicate actors, image inputs to the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from openrlhf_lora_sync.patch import reference_policy
from openrlhf_lora_sync.testing.cpu_deepspeed import process_env

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "qwen3"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REFERENCE_ATOL = 1e-6
MIN_POLICY_MOVE = 1e-2
WORKER_TIMEOUT_S = 600
TRITON_CROSS_ENTROPY = "flash_attn.ops.triton.cross_entropy"


def _batch(seed: int = 0):
    """Two sequences of 20 tokens, the second left-padded by 4, with 8 action tokens (the first one's last 2
    masked, as after an early EOS): what the experience maker passes to forward."""
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 256, (2, 20), generator=generator)
    attention_mask = torch.ones(2, 20, dtype=torch.long)
    attention_mask[1, :4] = 0
    action_mask = torch.ones(2, 8, dtype=torch.bool)
    action_mask[0, -2:] = False
    return sequences, action_mask, attention_mask


def _cpu_stack_stand_ins() -> None:
    """In a worker process: CPU answers for OpenRLHF's CUDA calls, and its log_probs_from_logits on its torch
    path (the CPU stack's flash-attn has Python files but no kernels: an import that fails sends OpenRLHF
    to its torch fallback, as patch/cpu_standins.py does in a CPU run's processes)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    sys.modules[TRITON_CROSS_ENTROPY] = None


# ---------------------------------------------------------------------------------------------------
# Worker: the equality check under ZeRO-3, in its own process.
# ---------------------------------------------------------------------------------------------------


def _lora_state(model) -> dict[str, torch.Tensor]:
    import deepspeed

    state = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            with deepspeed.zero.GatheredParameters([param]):
                state[name] = param.detach().clone()
    return state


def _fully_partitioned_train_configs() -> None:
    """Every parameter a ZeRO-3 partition, released outside a gather (persistence threshold 0), in the
    train configs OpenRLHF builds: what `zero3_released` checks. Wrapped around the patched
    get_ds_train_config, so offload.py's entries stay as it writes them."""
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    upstream = DeepspeedStrategy.get_ds_train_config

    def get_ds_train_config(self, *args, **kwargs):
        config = upstream(self, *args, **kwargs)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return config

    DeepspeedStrategy.get_ds_train_config = get_ds_train_config


def _engine_offload(engine) -> dict[str, str]:
    """Where the engine keeps parameters and optimizer states: DeepSpeed's parsed zero config of the
    engine strategy.prepare built, not a dict the test wrote."""
    zero = engine._config.zero_config
    return {
        kind: "none" if entry is None else str(entry.device)
        for kind, entry in (("param", zero.offload_param), ("optimizer", zero.offload_optimizer))
    }


def run_worker(model_dir: str, out: str) -> None:
    import deepspeed
    from openrlhf.models import Actor
    from openrlhf.trainer.ray import launcher, ppo_actor
    from openrlhf.utils import utils as openrlhf_utils
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf_lora_sync.patch import openrlhf_patch
    from openrlhf_lora_sync.testing import cpu_deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    _cpu_stack_stand_ins()
    upstream_dtype = openrlhf_utils.convert_to_torch_dtype
    openrlhf_utils.convert_to_torch_dtype = lambda name: (
        torch.float32 if name == "fp32" else upstream_dtype(name)
    )
    openrlhf_patch.apply()  # offload.py wraps Actor.__init__ and the strategy (LORA_SYNC_OFFLOAD_PARAMS)
    # torch's AdamW from OpenRLHF's optimizer config: DeepSpeed's CPU Adam (what an offloaded optimizer
    # gets) is a C++ extension compiled on first use, minutes on 2 cores.
    cpu_deepspeed.use_torch_adam()
    _fully_partitioned_train_configs()

    # fp32 (cpu_deepspeed.strategy() is bf16): the reference equality is checked to 1e-6.
    args = SimpleNamespace(ds=SimpleNamespace(param_dtype="fp32"), train=SimpleNamespace())
    strategy = DeepspeedStrategy(zero_stage=3, args=args)
    # As PolicyModelActor.init_model_from_pretrained: the Actor loaded under the train config, then
    # strategy.prepare((actor, cfg)), so the offload entries are the ones offload.py's wrappers write.
    policy = Actor(
        model_dir,
        attn_implementation="sdpa",
        param_dtype="fp32",
        lora_rank=8,
        lora_alpha=16,
        target_modules=LORA_TARGETS,
        ds_config=strategy.get_ds_train_config(),
    )
    optimizer_config = {
        "optim": "adam",
        "muon": {},
        "adam": {"lr": 0.05, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
        "lr_scheduler": "constant",
        "scheduler_steps": 1000,
        "max_norm": 0.0,
    }
    policy, optimizer, scheduler = strategy.prepare((policy, optimizer_config))
    engine = policy.model
    reference = Actor(
        model_dir, attn_implementation="sdpa", param_dtype="fp32", ds_config=strategy.get_ds_eval_config()
    )
    reference = strategy.prepare(reference)
    reference.eval()

    sequences, action_mask, attention_mask = _batch()

    def train_step() -> None:
        policy.train()
        log_probs = policy(sequences, action_mask, attention_mask)
        strategy.backward(-(log_probs.sum() / action_mask.sum()), policy, optimizer)
        strategy.optimizer_step(optimizer, policy, scheduler)

    for _ in range(3):
        train_step()

    actor_cls = ppo_actor.PolicyModelActor.__ray_metadata__.modified_class
    policy_actor = actor_cls.__new__(actor_cls)
    policy_actor.actor, policy_actor.strategy = policy, strategy
    reference_actor = SimpleNamespace(model=reference, strategy=strategy)
    flags = [p.requires_grad for p in engine.module.parameters()]
    zero3 = [hasattr(p, "ds_id") and p.data.numel() == 0 for p in engine.module.parameters()]

    policy_before = policy_actor.forward(sequences, action_mask, attention_mask)
    from_base = policy_actor.reference_forward(sequences, action_mask, attention_mask)
    policy_after = policy_actor.forward(sequences, action_mask, attention_mask)
    upstream_forward = launcher.ReferenceModelActor.__ray_metadata__.modified_class.forward
    upstream_reference = upstream_forward(reference_actor, sequences, action_mask, attention_mask)
    flags_after = [p.requires_grad for p in engine.module.parameters()]
    lora_before_step = _lora_state(engine.module)
    train_step()
    lora_after_step = _lora_state(engine.module)

    result = {
        "reference_diff": (from_base - upstream_reference).abs().max().item(),
        "policy_vs_reference": (policy_before - upstream_reference).abs().max().item(),
        "policy_unchanged": torch.equal(policy_before, policy_after),
        "flags_kept": flags == flags_after,
        "trainable": sum(flags),
        "zero3_released": all(zero3),
        "adapter_move_after": max(
            (lora_after_step[name] - lora_before_step[name]).abs().max().item() for name in lora_before_step
        ),
        "shape": list(from_base.shape),
        "offload": _engine_offload(engine),
    }
    Path(out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# 1: the trainer base offload (offload.py: ZeRO-3 parameters and optimizer in host memory), the reporter's
# configuration; the reference forward then gathers from the offloaded store like the policy's.
@pytest.mark.parametrize("offload_params", ["0", "1"])
def test_reference_from_disabled_adapters_equals_openrlhfs_reference_model(
    offload_params, tiny_model_dir, tmp_path
):
    env = process_env(LORA_SYNC_LORA_RANK="8", LORA_SYNC_OFFLOAD_PARAMS=offload_params)
    out, log = tmp_path / "result.json", tmp_path / "worker.log"
    command = [sys.executable, __file__, "--worker", str(tiny_model_dir(FAMILY)), str(out)]
    with log.open("w") as log_file:
        proc = subprocess.run(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=WORKER_TIMEOUT_S, check=False
        )
    if proc.returncode != 0:
        pytest.fail(f"worker failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    result = json.loads(out.read_text())
    print(result)
    assert result["zero3_released"], "the policy's parameters are not ZeRO-3 partitions"
    assert result["shape"] == [2, 8]
    # Read from the engine strategy.prepare built: offload.py's wrappers, not the test, set these.
    expected_device = "cpu" if offload_params == "1" else "none"
    assert result["offload"] == {"param": expected_device, "optimizer": expected_device}, result
    assert result["policy_vs_reference"] > MIN_POLICY_MOVE, result  # the control: training moved the policy
    assert result["reference_diff"] <= REFERENCE_ATOL, result
    assert result["policy_unchanged"] and result["flags_kept"] and result["trainable"] > 0, result
    assert result["adapter_move_after"] > 0, "a training step after the reference forward moved nothing"


# ---------------------------------------------------------------------------------------------------
# train_ppo_ray's set-up on a local Ray cluster.
# ---------------------------------------------------------------------------------------------------

TRAINER_NAME = "ppo-trainer-under-test"


class StopBeforeModelsLoad(Exception):
    pass


def _stop_before_models_load(self, *args, **kwargs):
    raise StopBeforeModelsLoad


def _trainer_without_data():
    """PPOTrainer's place in train(): OpenRLHF's BasePPOTrainer (its KL controller and RemoteExperienceMaker)
    from exactly what train() passes, without PPOTrainer's dataset and vLLM sampler."""
    import ray
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    class TrainerWithoutData(BasePPOTrainer):
        def __init__(
            self, pretrain, strategy, actor, critic, reward, reference, vllm_engines, **generate_kwargs
        ):
            super().__init__(strategy, actor, critic, reward, reference, vllm_engines, tokenizer=None)

        def get_max_steps(self) -> int:
            return 1

    # Detached: train() drops its handle when it stops; the test kills the actor.
    return ray.remote(num_cpus=0)(TrainerWithoutData).options(name=TRAINER_NAME, lifetime="detached")


def _load_policy(policy_actor, model_dir: str) -> None:
    """In the PolicyModelActor Ray actor: what forward reads (self.actor, self.strategy), with a LoRA whose B
    is random, so the policy differs from the base."""
    from openrlhf.models import Actor
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    _cpu_stack_stand_ins()
    actor = Actor(
        model_dir, attn_implementation="sdpa", lora_rank=8, lora_alpha=16, target_modules=LORA_TARGETS
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in actor.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    policy_actor.actor = actor
    policy_actor.strategy = DeepspeedStrategy(
        args=SimpleNamespace(ds=SimpleNamespace(param_dtype="bf16"), train=0)
    )


def _make_experience(trainer, samples):
    experiences = trainer.experience_maker.make_experience(samples)
    return [(e.action_log_probs, e.base_action_log_probs) for e in experiences]


def _set_up(monkeypatch, model_dir: Path, mode: str):
    """Run upstream train() (as the launcher runs the module) until it would load the models; return the
    trainer actor it started."""
    import runpy
    import warnings

    import ray
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import launcher
    from openrlhf_lora_sync.config.recipe import dry_run

    monkeypatch.setenv("LORA_SYNC_REFERENCE_FROM_BASE", mode)
    monkeypatch.setattr(ppo_trainer, "PPOTrainer", _trainer_without_data())
    monkeypatch.setattr(
        launcher.RayActorGroup.__wrapped__, "async_init_model_from_pretrained", _stop_before_models_load
    )
    # fmt: off
    args, _ = dry_run([
        "--actor.model_name_or_path", str(model_dir), "--ds.lora.rank", "8", "--ds.zero_stage", "3",
        "--algo.kl.init_coef", "0.01", "--algo.kl.use_loss", "--train.colocate_all",
        "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1", "--vllm.num_engines", "0",
        "--reward.remote_url", "rewards/math_answer.py", "--algo.advantage.estimator", "group_norm",
        "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "2", "--train.micro_batch_size", "1",
    ])
    # fmt: on
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before (other tests)
        train = runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="train_ppo_ray_under_test")["train"]
    with pytest.raises(StopBeforeModelsLoad):
        train(args)
    return ray.get_actor(TRAINER_NAME)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from openrlhf_lora_sync.patch.launch import ray_runtime_env
    from ray import cloudpickle

    # Test helpers go to the Ray workers by value: they cannot import this test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    runtime_env = ray_runtime_env()
    runtime_env["env_vars"].update(
        LORA_SYNC_LORA_RANK="8", LORA_SYNC_REFERENCE_FROM_BASE="1", OMP_NUM_THREADS="1"
    )
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, runtime_env=runtime_env, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_train_ppo_ray_starts_no_reference_model_and_still_gets_reference_log_probs(
    ray_cluster, tiny_model_dir, monkeypatch
):
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf_lora_sync.patch import openrlhf_patch

    ray = ray_cluster
    openrlhf_patch.apply()
    monkeypatch.setenv("LORA_SYNC_LORA_RANK", "8")
    model_dir = tiny_model_dir(FAMILY)

    trainer = _set_up(monkeypatch, model_dir, mode="1")
    groups = ray.get(
        trainer.__ray_call__.remote(
            lambda t: (
                type(t.reference_model_group).__name__,
                t.experience_maker.initial_model_group.policy_group,
            )
        )
    )
    assert groups[0] == "ReferenceFromPolicy"
    policy_group = groups[1]
    assert policy_group.ray_actor_type.__ray_metadata__.class_name == "PolicyModelActor"
    ray.get(policy_group._actor_handlers[0].__ray_call__.remote(_load_policy, str(model_dir)))
    sequences, action_mask, attention_mask = _batch()
    samples = [
        Experience(
            sequences=sequences[i : i + 1],
            attention_mask=attention_mask[i : i + 1],
            action_mask=action_mask[i : i + 1],
            rewards=torch.zeros(1),
        )
        for i in range(2)
    ]
    results = ray.get(trainer.__ray_call__.remote(_make_experience, samples))
    ray.kill(trainer)

    monkeypatch.setitem(sys.modules, TRITON_CROSS_ENTROPY, None)
    base = Actor(str(model_dir), attn_implementation="sdpa").eval()
    with torch.no_grad():
        expected = base(sequences, action_mask, attention_mask)
    policy = torch.cat([policy_lp for policy_lp, _ in results])
    reference = torch.cat([reference_lp for _, reference_lp in results])
    reference_diff, policy_diff = (reference - expected).abs().max(), (policy - expected).abs().max()
    print(f"reference vs base {reference_diff:.3g}, policy vs base {policy_diff:.3g}")
    assert policy_diff > MIN_POLICY_MOVE  # the control: the policy is not the base
    assert reference_diff <= REFERENCE_ATOL

    trainer = _set_up(monkeypatch, model_dir, mode="0")  # the control: upstream's reference group
    reference_group = ray.get(trainer.__ray_call__.remote(lambda t: t.reference_model_group))
    ray.kill(trainer)
    assert reference_group.ray_actor_type.__ray_metadata__.class_name == "ReferenceModelActor"
    assert len(reference_group._actor_handlers) == 1
    for handle in reference_group._actor_handlers:
        ray.kill(handle)


# ---------------------------------------------------------------------------------------------------
# The setting.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, rank, expected",
    [("", "8", True), ("1", "8", True), ("0", "8", False), ("1", "0", False), ("", "", False)],
)
def test_reference_from_base_setting(value, rank, expected, monkeypatch):
    monkeypatch.setenv("LORA_SYNC_REFERENCE_FROM_BASE", value)
    monkeypatch.setenv("LORA_SYNC_LORA_RANK", rank)
    assert reference_policy.reference_from_base() is expected


def test_reference_from_base_refuses_a_bad_value(monkeypatch):
    monkeypatch.setenv("LORA_SYNC_REFERENCE_FROM_BASE", "yes")
    with pytest.raises(ValueError, match="LORA_SYNC_REFERENCE_FROM_BASE='yes'"):
        reference_policy.reference_from_base()


def test_adapters_disabled_refuses_a_model_without_lora():
    with (
        pytest.raises(TypeError, match="sync.reference_from_base: false"),
        reference_policy.adapters_disabled(torch.nn.Linear(2, 2)),
    ):
        pass


def test_reference_stand_in_routes_forward_and_refuses_calls_it_cannot_route():
    policy_group = SimpleNamespace(
        async_run_method_batch=lambda method_name, **kwargs: (method_name, kwargs),
        async_run_method=lambda method_name, *args, **kwargs: method_name,
    )
    view = reference_policy.ReferenceFromPolicy(policy_group=policy_group)
    assert view.async_run_method_batch("forward", sequences=[1]) == ("reference_forward", {"sequences": [1]})
    assert view.async_run_method(method_name="empty_cache") == "empty_cache"
    with pytest.raises(NotImplementedError, match="sync.reference_from_base: false"):
        view.async_run_method("save_model")
    with pytest.raises(RuntimeError, match="before the policy group was bound"):
        reference_policy.ReferenceFromPolicy().async_run_method_batch("forward", sequences=[1])
    assert view.async_init_model_from_pretrained("strategy", "pretrain") == []


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        run_worker(*sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker MODEL_DIR OUT_FILE")
