"""KL without a reference model: with LoRA the reference policy is the base model, which is the policy with
its adapters disabled.

OpenRLHF 0.11.2's `train_ppo_ray` starts a reference model group (`ReferenceModelActor`: the base loaded a
second time, a second ZeRO-3 shard on the same GPUs, or all of it in host memory with --ref.offload)
whenever --algo.kl.init_coef > 0, and `RemoteExperienceMaker.make_experience` asks that group's `forward`
for `base_action_log_probs` (the KL penalty, or --algo.kl.use_loss's KL loss). With LoRA the frozen base
the policy trains on is that same model, so the policy actors compute those log-probs themselves, with the
adapters switched off by peft's `disable_adapter()`: no second model in GPU or host memory, no second load.

On when the recipe key `sync.reference_from_base` is true (LORA_SYNC_REFERENCE_FROM_BASE=1, the default)
and the run has LoRA (LORA_SYNC_LORA_RANK > 0: the launcher sets it from --ds.lora.rank); off (0), or with
rank 0, upstream's reference model group. Rank 0 is ignored rather than refused here: the launcher and
render_recipe already refuse a run without LoRA through this patch (config_checks.py).

What `install()` (called by openrlhf_patch.apply()) changes:
- `launcher.RayActorGroup`, which train_ppo_ray imports when the launcher runs it: asked for a group of
  `ReferenceModelActor`, it returns a `ReferenceFromPolicy` instead (no Ray actor, no share of a GPU
  bundle, nothing loaded); every other group is upstream's;
- `RemoteExperienceMaker.__init__` (in the trainer actor): binds that stand-in to the policy group it gets,
  so the reference "forward" goes to the policy actors (their `execute_batch`, with upstream's batching);
- `PolicyModelActor`: a subclass with `reference_forward`: upstream's `PolicyModelActor.forward` (its VLM
  inputs, eval mode and `Actor.forward` with the action mask) inside `disable_adapter()`.

When it runs: `make_experience` calls the reference right after the policy's own forward, on the same
actors (with colocate_all it waits for the policy forward first; otherwise Ray runs an actor's calls one
at a time): after the rollout put vLLM to sleep (--vllm.enable_sleep) and before `ppo_train`'s
`reload_states`, so the model is in exactly the state the policy forward of the same step runs in
(--ds.enable_sleep offloads only optimizer states and gradients; with the trainer base offload,
offload.py, both gather from host memory; tests/trainer/test_reference_policy.py runs both). Under ZeRO-3 the
forward gathers each module's parameters as upstream's does; the skipped lora_A/lora_B are not needed
(DeepSpeed's prefetch trace sees another module order and re-traces, which costs prefetching for that
step, not correctness: docs/memory.md).

peft's `disable_adapter()` sets requires_grad False on every adapter and, on exit, True on the active
adapter's; the trainer owns those flags (an adapter it froze must stay frozen), so `adapters_disabled`
puts every parameter's flag back as it was.

Does not cover: a reference other than the policy's own base (OpenRLHF 0.11.2 loads the reference from
--actor.model_name_or_path too, so there is no other), adapters merged into the base weights (the patch
never merges in place), or runs started without this package's launcher (nothing is patched there). The
flags --ref.offload and --ref.num_gpus_per_node then load nothing, but upstream's colocation assert on
ref.num_nodes/ref.num_gpus_per_node still runs, so recipes keep them equal to the actor's.
"""

from __future__ import annotations

import contextlib
import functools
import logging

from openrlhf_lora_sync.base import settings

logger = logging.getLogger("openrlhf_lora_sync")

ENV = settings.get("sync.reference_from_base").env
# The experience maker's calls on its reference group -> the policy actor method that answers each.
POLICY_METHOD_FOR = {"forward": "reference_forward", "empty_cache": "empty_cache"}


def reference_from_base() -> bool:
    """Whether the KL reference is the policy with its adapters disabled (LORA_SYNC_REFERENCE_FROM_BASE, 1 by
    default) for this run, which must have LoRA (LORA_SYNC_LORA_RANK > 0)."""
    return settings.read(ENV) and settings.read("LORA_SYNC_LORA_RANK") > 0


@contextlib.contextmanager
def adapters_disabled(model):
    """The block runs the base model: peft's `disable_adapter()` on `model` (a PeftModel, or the DeepSpeed
    engine wrapping one), with every parameter's requires_grad kept as it was."""
    from peft import PeftModel

    peft_model = model if isinstance(model, PeftModel) else getattr(model, "module", None)
    if not isinstance(peft_model, PeftModel):
        raise TypeError(
            f"{ENV}=1 needs a LoRA policy (a peft model), got {type(model).__name__}; set "
            "sync.reference_from_base: false or --ds.lora.rank > 0"
        )
    flags = [(param, param.requires_grad) for param in peft_model.parameters()]
    try:
        with peft_model.disable_adapter():
            yield
    finally:
        for param, requires_grad in flags:
            param.requires_grad_(requires_grad)


class ReferenceFromPolicy:
    """Stands where train_ppo_ray's reference model group would: answers the experience maker's reference
    calls with the policy group's actors (bound by RemoteExperienceMaker.__init__), and loads nothing."""

    def __init__(self, policy_group=None) -> None:
        self.policy_group = policy_group

    def bound_to(self, policy_group) -> ReferenceFromPolicy:
        return ReferenceFromPolicy(policy_group)

    def async_init_model_from_pretrained(self, *args, **kwargs) -> list:
        return []  # the policy actors load the one model

    def _policy_method(self, method_name: str) -> str:
        if self.policy_group is None:
            raise RuntimeError("the KL reference from the base was called before the policy group was bound")
        if method_name not in POLICY_METHOD_FOR:
            raise NotImplementedError(
                f"the reference group's {method_name!r} has no policy-side counterpart (did OpenRLHF change "
                "how it calls the reference?); set sync.reference_from_base: false for upstream's reference"
            )
        return POLICY_METHOD_FOR[method_name]

    def async_run_method_batch(self, method_name: str, **kwargs) -> list:
        policy_method = self._policy_method(method_name)  # before the group: refuse what it cannot route
        return self.policy_group.async_run_method_batch(method_name=policy_method, **kwargs)

    def async_run_method(self, method_name: str, *args, **kwargs) -> list:
        policy_method = self._policy_method(method_name)
        return self.policy_group.async_run_method(policy_method, *args, **kwargs)


def _reference_aware_actor_group(upstream_group, reference_actor):
    """train_ppo_ray's `RayActorGroup(...)`: upstream's, except the reference model group in this mode."""

    @functools.wraps(upstream_group, updated=())
    def actor_group(num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs):
        if ray_actor_type is reference_actor and reference_from_base():
            logger.info("KL reference: the policy with its LoRA adapters disabled; no reference model loaded")
            return ReferenceFromPolicy()
        return upstream_group(num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs)

    return actor_group


def _binding_reference_to_policy(upstream_init):
    @functools.wraps(upstream_init)
    def __init__(
        self, actor_model_group, critic_model_group, reward_model_group, initial_model_group, *a, **kw
    ):
        if isinstance(initial_model_group, ReferenceFromPolicy):
            initial_model_group = initial_model_group.bound_to(actor_model_group)
        upstream_init(
            self, actor_model_group, critic_model_group, reward_model_group, initial_model_group, *a, **kw
        )

    return __init__


def _policy_actor_with_reference(upstream_actor):
    """A Ray actor class: OpenRLHF's policy actor plus `reference_forward` (a subclass, because actor handles
    only expose the methods the class had when `ray.remote` built it), with upstream's actor options."""
    import ray

    upstream = upstream_actor.__ray_metadata__.modified_class.__bases__[0]

    class PolicyModelActor(upstream):
        def reference_forward(self, *args, **kwargs):
            """base_action_log_probs: upstream's forward (same arguments) with the adapters disabled."""
            with adapters_disabled(self.actor.model):
                return self.forward(*args, **kwargs)

    PolicyModelActor.__qualname__ = upstream.__qualname__
    return ray.remote(**upstream_actor._default_options)(PolicyModelActor)


def install() -> None:
    """Patch OpenRLHF in this process (openrlhf_patch.apply() calls it once)."""
    from openrlhf.trainer.ppo_utils import experience_maker
    from openrlhf.trainer.ray import launcher, ppo_actor

    launcher.RayActorGroup = _reference_aware_actor_group(
        launcher.RayActorGroup, launcher.ReferenceModelActor
    )
    maker = experience_maker.RemoteExperienceMaker
    maker.__init__ = _binding_reference_to_policy(maker.__init__)
    ppo_actor.PolicyModelActor = _policy_actor_with_reference(ppo_actor.PolicyModelActor)
