"""The run-time patch of OpenRLHF 0.11.2: LoRA-aware merge-then-sync in place of `broadcast_to_vllm`.

`apply()` is idempotent and is run in every process that needs it: the driver (by the launcher,
launch.py) and every Ray worker process, nested ones included (the launcher passes it to `ray.init` as
`runtime_env["worker_process_setup_hook"]`). vLLM's engine-core process is not a Ray worker; it gets
this package's worker extension by import name, which the patched engine actor passes to vLLM.

What it changes:
- `ActorPPOTrainer.__init__`: also refuses adapters merge-then-sync cannot merge, at start;
- `ActorPPOTrainer.ppo_train`: its returned status (logged by OpenRLHF) carries the last sync's stats;
- `ActorPPOTrainer.broadcast_to_vllm` -> `lora_broadcast_to_vllm`: every trainer rank gathers the
  policy one module at a time under ZeRO-3 and merges LoRA out of place (merge.py); rank 0 sends
  buckets under HF checkpoint names in the engine dtype (bf16: OpenRLHF hardcodes it) over the chosen
  transport, full or delta as the engines' state requires (plan.py), and logs one line per sync;
- `DeepspeedStrategy.save_model` (the peft adapter at --ckpt.save_steps with --ckpt.save_hf, and the final
  one in --ckpt.output_dir): rank 0 writes into a staging directory that replaces the target atomically
  (checkpoint.py), so an interrupted save leaves the previous checkpoint whole;
- `RolloutRayActor` (the vLLM engine actor): loads `LoraSyncWorkerExtension` instead of OpenRLHF's
  `WorkerWrap`; gains `lora_sync_rpc` (collective_rpc to its workers) and `reset_all_caches` (prefix,
  multimodal and encoder caches through the engine, which knows its scheduler); `sleep` honours
  LORA_SYNC_VLLM_SLEEP_LEVEL (2 discards weights, so every following sync is full); in adapter sync mode
  it starts vLLM with LoRA enabled and every request it submits carries the adapter installed last;
- the KL reference (reference_policy.py): no reference model group; the policy actors compute the
  reference log-probs with their adapters disabled;
- with LORA_SYNC_OFFLOAD_PARAMS=1, the policy actor's ZeRO-3 config (offload.py): parameters and
  optimizer in pinned host memory.

Settings: read from the environment with settings.read (the launcher forwards LORA_SYNC_* to every Ray
worker); each one's recipe key, variable, type, choices, default and effect is in settings.SETTINGS.
The probe (sync.probe_every, sync.probe_threshold; probe.py): its floor is measured once, before the first
sync; each probe logs sync/probe_* (reading, floor, ratio, verdict), warns above WARN_RATIO and stops the run
with ProbeFailed above FAIL_RATIO.

Transport (sync.transport=auto, settings.resolved_transport): broadcast when any engine actor's Ray
node id differs from trainer rank 0's (shared memory and CUDA IPC reach only this node; asked once, at
the first sync, and cached on the trainer as `_lora_sync_nodes`), else shm when colocated or when the
trainer has no CUDA, else broadcast (NCCL between separate GPUs). The broadcast carries adapter mode's
adapter too. The per-sync summary line names the transport (tests/test_two_node.py: two Ray nodes).

Does not cover: OpenRLHF/vLLM releases other than the pinned ones, which `apply()` refuses.
"""

from __future__ import annotations

import logging

from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.base.pins import check_versions
from openrlhf_lora_sync.patch import cpu_standins

logger = logging.getLogger("openrlhf_lora_sync")
logger.setLevel(logging.INFO)  # the per-sync summary is INFO; apply() gives it a handler

_APPLIED_MARK = "_openrlhf_lora_sync_patched"


def sleep_level() -> int:
    return settings.read("sync.vllm_sleep_level")


def sync_transport(colocated: bool, trainer_node: str | None = None, engine_nodes: tuple = ()) -> str:
    """LORA_SYNC_TRANSPORT, with auto resolved by settings.resolved_transport's rule: broadcast to engines
    on another Ray node than trainer rank 0 (`trainer_node`, `engine_nodes`: Ray node ids), else shm when
    colocated or the trainer has no CUDA, else broadcast. cuda_ipc is opt-in until measured on GPUs."""
    cuda = __import__("torch").cuda.is_available()
    name = settings.resolved_transport(
        settings.read("sync.transport"),
        colocated,
        trainer_node=trainer_node,
        engine_nodes=engine_nodes,
        trainer_cuda=cuda,
    )
    if name == "cuda_ipc" and not cuda:
        raise ValueError("LORA_SYNC_TRANSPORT=cuda_ipc needs CUDA on the trainer; use shm")
    return name


def sync_mode() -> str:
    """LORA_SYNC_MODE: merge (default: the engines get merged weights) or adapter (they keep the base and
    apply the adapter with vLLM's LoRA layers: adapter_mode.py)."""
    return settings.read("sync.mode")


def adapter_lora_rank() -> int:
    """LORA_SYNC_LORA_RANK: the trainer's LoRA rank, which adapter-mode engines size their LoRA layers for
    (the launcher sets it from --ds.lora.rank)."""
    rank = settings.read("LORA_SYNC_LORA_RANK")
    if rank <= 0:
        raise ValueError(
            "adapter sync mode: LORA_SYNC_LORA_RANK is not set; start through python -m "
            "openrlhf_lora_sync.patch.launch (it sets it from --ds.lora.rank) or set it to that rank"
        )
    return rank


class RayEngines:
    """OpenRLHF's vLLM engine actors, as sync.py's Engines."""

    def __init__(self, engine_actors) -> None:
        self.actors = engine_actors

    def rpc(self, method: str, *args) -> list:
        return self.rpc_each(method, [args] * len(self.actors))

    def rpc_each(self, method: str, per_engine_args: list[tuple]) -> list:
        import ray

        refs = [
            a.lora_sync_rpc.remote(method, *args)
            for a, args in zip(self.actors, per_engine_args, strict=True)
        ]
        return [r for results in ray.get(refs) for r in results]

    def __len__(self) -> int:
        return len(self.actors)

    def reset_caches(self) -> None:
        import ray

        ray.get([a.reset_all_caches.remote() for a in self.actors])

    def each(self, method: str, **kwargs) -> None:
        """`method` of every engine actor (sleep, wake_up), waited for."""
        import ray

        ray.get([getattr(a, method).remote(**kwargs) for a in self.actors])

    def node_ids(self) -> tuple[str, ...]:
        """The Ray node id of each engine actor (the patched actor's node_id)."""
        import ray

        return tuple(ray.get([a.node_id.remote() for a in self.actors]))


def _sync_nodes(engines) -> tuple[str | None, tuple[str, ...]]:
    """(this process's Ray node id, the engines' node ids), what the transport rule compares; (None, ())
    without Ray or for engines that are not Ray actors (sync.LocalEngines: in this process)."""
    import ray

    if not ray.is_initialized() or not hasattr(engines, "node_ids"):
        return None, ()
    return ray.get_runtime_context().get_node_id(), engines.node_ids()


def _asked_once(trainer, attribute: str, ask, rank: int, distributed: bool):
    """trainer.<attribute>, set at the first sync from rank 0's ask() and broadcast to the other ranks:
    every rank must plan the same units (the gathers are collective) and pick the same transport."""
    value = getattr(trainer, attribute, None)
    if value is None:
        import torch

        shared = [ask() if rank == 0 else None]
        if distributed:
            torch.distributed.broadcast_object_list(shared, src=0)
        value = shared[0]
        setattr(trainer, attribute, value)
    return value


def lora_broadcast_to_vllm(self) -> None:
    """Replacement for ActorPPOTrainer.broadcast_to_vllm (runs on every trainer rank)."""
    import torch

    from openrlhf_lora_sync.sync import probe
    from openrlhf_lora_sync.sync.adapter_mode import AdapterSyncState, sync_adapter
    from openrlhf_lora_sync.sync.plan import SyncState
    from openrlhf_lora_sync.sync.sync import sync_weights

    adapter_mode = sync_mode() == "adapter"
    state = getattr(self, "_lora_sync_state", None)
    if state is None:
        state = self._lora_sync_state = AdapterSyncState() if adapter_mode else SyncState()
    if settings.read("sync.stale_engine_control") and getattr(self, "_lora_sync_count", 0) > 0:
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            logger.info(
                "weight sync: skipped (sync.stale_engine_control: the engines keep the first sync's policy)"
            )
        self._lora_sync_last_stats = None
        return
    if sleep_level() == 2:
        state.weights_lost("vLLM sleep level 2 discarded the engine's weights")
    distributed = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    engines = RayEngines(self.vllm_engines)
    # Rank 0's Ray node id and the engines': engines on another node get the broadcast transport.
    trainer_node, engine_nodes = _asked_once(
        self, "_lora_sync_nodes", lambda: _sync_nodes(engines), rank, distributed
    )
    transport_name = transport = sync_transport(
        self.strategy.args.train.colocate_all, trainer_node, engine_nodes
    )
    if transport == "broadcast":
        from openrlhf_lora_sync.sync.transport import BroadcastTransport

        if getattr(self, "_lora_sync_broadcast", None) is None:
            self._lora_sync_broadcast = BroadcastTransport(
                engines, self.strategy.args.vllm.tensor_parallel_size
            )
        transport = self._lora_sync_broadcast
    packed = _asked_once(
        self, "_lora_sync_packed", lambda: engines.rpc("packed_modules_mapping")[0], rank, distributed
    )
    force_full = settings.read("sync.force_full")
    if adapter_mode:
        if force_full:
            state.weights_lost("forced")
        # The base weights are resent only when the engines lost them; the adapter goes every time.
        sync, mode_kwargs = sync_adapter, {}
    else:
        sync, mode_kwargs = sync_weights, {"force_full": force_full}
    probing = settings.read("sync.probe_every") > 0
    if probing and getattr(self, "_lora_sync_count", 0) == 0 and sleep_level() != 2:
        # Before the first sync the engines still hold the checkpoint: the probe's noise floor, once a run.
        self._lora_sync_probe_floor = _calibrate_probe(self, engines, rank, distributed)
    stats = sync(
        self.actor.model.module,
        engines,
        state,
        dtype=torch.bfloat16,  # create_vllm_engines hardcodes bf16 engines
        packed_modules=packed,
        bucket_bytes=settings.read("sync.bucket_mb") << 20,
        send=rank == 0,
        transport=transport,
        **mode_kwargs,
    )
    stats.transport = transport_name
    self._lora_sync_count = getattr(self, "_lora_sync_count", 0) + 1
    if probing and self._lora_sync_count % settings.read("sync.probe_every") == 0:
        try:
            _probe_after_sync(self, engines, stats, rank, distributed)
        except probe.ProbeFailed:
            # Whoever catches this and goes on gets a full resync next time, not a delta onto bad weights.
            state.weights_lost("the post-sync probe failed")
            raise
    if rank == 0:
        logger.info("%s", stats)
    self._lora_sync_last_stats = stats
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# OpenRLHF's engines run in bf16 (create_vllm_engines hardcodes it); the probe's floors are per dtype.
ENGINE_DTYPE = "bfloat16"


def _engines_sleep(trainer) -> bool:
    return getattr(getattr(trainer.strategy.args, "vllm", None), "enable_sleep", False)


def _wake_for_probe(trainer, engines) -> None:
    """With vLLM sleep mode OpenRLHF wakes only the engines' weights for the sync; a forward needs the KV
    cache, so the probe wakes it now rather than at the next rollout (vLLM's wake_up skips what is awake)."""
    if _engines_sleep(trainer):
        engines.each("wake_up", tags=["kv_cache"])


def _release_kv_cache(trainer, engines) -> None:
    """Back to what OpenRLHF leaves the engines in for a sync (weights awake, KV cache freed), so the
    calibration before the first sync does not hold the KV cache through it: vLLM frees the KV cache only
    by sleeping (level 1 keeps the weights in host memory), then the weights are woken again."""
    if _engines_sleep(trainer):
        engines.each("sleep", level=1)
        engines.each("wake_up", tags=["weights"])


def _shared(value, distributed: bool):
    """Rank 0's `value` on every rank."""
    import torch

    shared = [value]
    if distributed:
        torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def _probe_tokens(trainer, engines, rank: int, distributed: bool, lora_request=None) -> list[int]:
    """probe.probe_token_ids from rank 0's engines (woken for it), on every rank. `lora_request`: in-process
    engines only (OpenRLHF's engine actors attach their installed adapter themselves)."""
    from openrlhf_lora_sync.sync import probe

    if rank != 0:
        return _shared(None, distributed)
    _wake_for_probe(trainer, engines)
    return _shared(probe.probe_token_ids(engines, trainer.actor.model.module, lora_request), distributed)


def _policy_logprobs(model, token_ids, rank: int, base: bool = False):
    """The policy's probe logprobs where they are needed: on every rank when ZeRO-3 partitions the
    parameters (the forward is collective), else on rank 0 alone."""
    from openrlhf_lora_sync.sync import probe

    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    return probe.policy_prompt_logprobs(model, token_ids, base=base) if partitioned or rank == 0 else None


def _calibrate_probe(trainer, engines, rank: int, distributed: bool):
    """The probe's tokens and floor (probe.py), before the first sync, on every rank: the engines as loaded
    from the checkpoint against the policy with its adapters switched off. Logged once."""
    import dataclasses

    from openrlhf_lora_sync.sync import probe

    model = trainer.actor.model.module
    token_ids = _probe_tokens(trainer, engines, rank, distributed)
    policy = _policy_logprobs(model, token_ids, rank, base=True)
    floor = None
    if rank == 0:
        floor = probe.measure_floor(policy, probe.engine_prompt_logprobs(engines, token_ids), token_ids)
        threshold = settings.read("sync.probe_threshold")
        if threshold is not None:
            floor = dataclasses.replace(floor, threshold=threshold)
        _release_kv_cache(trainer, engines)
        logger.info(
            "post-sync probe: %d tokens, %s; it warns above %gx the floor and stops the run above %gx",
            len(token_ids) - floor.scored_from,
            floor.describe(),
            probe.WARN_RATIO,
            probe.FAIL_RATIO,
        )
    return _shared(floor, distributed)


def _probe_after_sync(trainer, engines, stats, rank: int, distributed: bool) -> None:
    """Post-sync probe (probe.py) against `engines` (RayEngines, or sync.LocalEngines in tests) and the
    floor _calibrate_probe measured; without one (sleep level 2 discards the checkpoint before the first
    sync) the first sync's reading becomes the floor when it is plausible as noise. Fills the stats' probe
    numbers on every rank, warns (rank 0) between WARN_RATIO and FAIL_RATIO, and raises ProbeFailed on
    every rank above (a raise on rank 0 alone would leave the other ranks waiting at the sync's barrier).
    The KV cache it wakes stays allocated for the rest of the sync. Not run on GPUs yet."""
    import time

    from openrlhf_lora_sync.sync import probe
    from openrlhf_lora_sync.sync.adapter_mode import AdapterSyncState

    model = trainer.actor.model.module
    start = time.perf_counter()
    floor = getattr(trainer, "_lora_sync_probe_floor", None)
    state = getattr(trainer, "_lora_sync_state", None)
    lora_request = state.lora_request() if isinstance(state, AdapterSyncState) else None
    token_ids = _probe_tokens(trainer, engines, rank, distributed, lora_request)
    policy = _policy_logprobs(model, token_ids, rank)
    # The floor's own tokens too (probe.with_floor_tokens); `floor` is the same on every rank.
    policy_on_floor_tokens = _policy_logprobs(model, floor.token_ids, rank) if floor else None
    outcome = None
    if rank == 0:
        engine = probe.engine_prompt_logprobs(engines, token_ids, lora_request)
        try:
            if floor is None:
                threshold = settings.read("sync.probe_threshold")
                floor = probe.fixed_floor(token_ids, ENGINE_DTYPE, threshold)
                if threshold is None:
                    floor = probe.first_sync_floor(probe.judge(policy, engine, floor, ENGINE_DTYPE, 0.0))
            result = probe.judge(policy, engine, floor, ENGINE_DTYPE, time.perf_counter() - start)
            if policy_on_floor_tokens is not None:
                on_floor = probe.engine_prompt_logprobs(engines, floor.token_ids, lora_request)
                on_floor_tokens = probe.judge(policy_on_floor_tokens, on_floor, floor, ENGINE_DTYPE, 0.0)
                result = probe.with_floor_tokens(result, on_floor_tokens)
            outcome = result, floor
        except probe.ProbeFailed as failed:
            outcome = str(failed), None
    result, floor = _shared(outcome, distributed)
    if isinstance(result, str):
        raise probe.ProbeFailed(result)
    trainer._lora_sync_probe_floor = floor
    stats.probe = result.as_metrics()
    if result.verdict == "warn" and rank == 0:
        logger.warning("%s", probe.warning_message(result, str(stats)))
    probe.check(result, str(stats))


def _checking_adapters_at_start(upstream_init):
    """Refuse adapters merge-then-sync cannot merge (DoRA, LoRA on embeddings...), or in adapter sync mode
    those vLLM's LoRA cannot serve, when the trainer is built, before the first rollout, rather than at the
    first sync after a training step."""
    from openrlhf_lora_sync.sync.adapter_mode import check_adapter_mode_supported
    from openrlhf_lora_sync.sync.merge import check_supported_adapters

    def __init__(self, *args, **kwargs):
        upstream_init(self, *args, **kwargs)
        check = check_adapter_mode_supported if sync_mode() == "adapter" else check_supported_adapters
        check(self.actor.model.module)

    return __init__


def _with_sync_metrics(upstream_ppo_train):
    """Add the last sync's numbers (sync/full, sync/bytes, sync/seconds, ...) to the training status, which
    OpenRLHF logs to wandb/tensorboard with its own metrics. They describe the sync that put in place the
    policy this step's rollouts were generated with."""

    def ppo_train(self, kl_ctl: float):
        status = upstream_ppo_train(self, kl_ctl)
        stats = getattr(self, "_lora_sync_last_stats", None)
        if stats is not None:
            status.update(stats.as_metrics())
        return status

    return ppo_train


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


def _recording_metrics(upstream_save_logs):
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


def _with_rollout_parity(upstream_rollout_stats):
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


def _closing_wandb(upstream_close):
    """WandbLogger.close, then wandb.teardown(): finish() can return before wandb's service process has
    written the run, and the PPOTrainer actor is ended by Ray right after fit, which otherwise logs wandb's
    "Connection lost" traceback from its exit handler (seen on CPU runs)."""

    def close(self):
        upstream_close(self)
        self.handle.teardown()

    return close


def _lora_engine_actor(upstream_actor):
    """A Ray actor class: OpenRLHF's engine actor plus what the sync needs. Methods must exist when
    `ray.remote` builds the class (actor handles only expose those), hence a subclass, not attributes
    added to the upstream class afterwards."""
    import ray

    from openrlhf_lora_sync.sync.worker_extension import WORKER_EXTENSION_CLS

    upstream = upstream_actor.__ray_metadata__.modified_class.__bases__[0]

    class LoraSyncRolloutRayActor(upstream):
        async def __init__(self, *args, **kwargs):
            kwargs["worker_extension_cls"] = WORKER_EXTENSION_CLS
            kwargs = cpu_standins.engine_kwargs(kwargs)
            self._sleep_mode = bool(kwargs.get("enable_sleep_mode"))
            self._never_sampled = never_sampled_token_ids(kwargs["model"], kwargs.get("mm_pad_token_ids"))
            adapter_mode = sync_mode() == "adapter"
            if adapter_mode:
                from openrlhf_lora_sync.sync.adapter_mode import engine_lora_kwargs

                kwargs.update(engine_lora_kwargs(adapter_lora_rank()))
            await super().__init__(*args, **kwargs)
            # Adapter mode: every request upstream's generate submits carries the adapter installed last
            # (None until the first sync: the engine then serves the base, which is the initial policy).
            self.lora_request = None
            if adapter_mode:
                submit = self.llm.generate

                def generate_with_adapter(*args, **kwargs):
                    return submit(*args, lora_request=self.lora_request, **kwargs)

                self.llm.generate = generate_with_adapter

        async def sleep(self, level=None):
            if self._sleep_mode:  # off on CPU (cpu_standins.ENGINE_SWITCHES): nothing to free
                await super().sleep(level=sleep_level() if level is None else level)

        async def wake_up(self, tags=None):
            if self._sleep_mode:
                await super().wake_up(tags=tags)

        async def generate_responses(self, prompt, label, sampling_params, *args, **kwargs):
            # sampling_params is this actor's own copy (Ray deserialized it), shared by the executors.
            rollout_sampling(sampling_params, self._never_sampled)
            return await super().generate_responses(prompt, label, sampling_params, *args, **kwargs)

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        async def lora_sync_rpc(self, method: str, *args):
            results = await self.llm.collective_rpc(method, args=args)
            if method in ("install_lora_adapter", "install_lora_adapter_broadcast"):
                from openrlhf_lora_sync.sync.adapter_mode import lora_request_for

                self.lora_request = lora_request_for(results[0]["lora_id"])
            return results

        async def reset_all_caches(self) -> None:
            await self.llm.reset_prefix_cache()
            await self.llm.reset_mm_cache()
            await self.llm.reset_encoder_cache()

    LoraSyncRolloutRayActor.__qualname__ = LoraSyncRolloutRayActor.__name__ = "RolloutRayActor"
    return ray.remote(LoraSyncRolloutRayActor)


def _enter_run_workdir() -> None:
    """Work in the launcher's directory (LORA_SYNC_WORKDIR), where this host has it: Ray starts workers in
    the directory its node was started from, and OpenRLHF opens the data's relative image paths in the
    engine actors. Nothing without the variable (tests, processes not started by the launcher)."""
    import os

    workdir = settings.read("LORA_SYNC_WORKDIR")
    if workdir and os.path.isdir(workdir) and os.path.realpath(os.getcwd()) != os.path.realpath(workdir):
        os.chdir(workdir)


def apply() -> None:
    """Patch OpenRLHF in this process (idempotent). Raises UnsupportedVersionError on other releases."""
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import ppo_actor, vllm_engine
    from openrlhf.utils import logging_utils
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf.utils.logging_utils import init_logger

    from openrlhf_lora_sync.patch import offload, reference_policy
    from openrlhf_lora_sync.patch.checkpoint import atomic_save_model, logging_resume
    from openrlhf_lora_sync.patch.reward_errors import install as report_reward_errors

    trainer_cls = ppo_actor.ActorPPOTrainer
    if getattr(trainer_cls, _APPLIED_MARK, False):
        return
    check_versions()
    _enter_run_workdir()
    cpu_standins.install()  # no CUDA only: OpenRLHF's unconditional CUDA calls answered (cpu_standins.py)
    # OpenRLHF's own handler (INFO, stdout, its format): the one summary line per sync is in the run's log
    # at INFO, next to OpenRLHF's lines, and warnings stay for what needs action.
    init_logger(logger.name)
    # Upstream's own sync stays callable (tools/bench_trainer_sync.py times it against the patch's).
    trainer_cls.upstream_broadcast_to_vllm = trainer_cls.broadcast_to_vllm
    trainer_cls.broadcast_to_vllm = lora_broadcast_to_vllm
    trainer_cls.__init__ = _checking_adapters_at_start(trainer_cls.__init__)
    trainer_cls.ppo_train = _with_sync_metrics(trainer_cls.ppo_train)
    base_trainer = ppo_trainer.BasePPOTrainer
    base_trainer.save_logs_and_checkpoints = _recording_metrics(base_trainer.save_logs_and_checkpoints)
    base_trainer._compute_rollout_stats = _with_rollout_parity(base_trainer._compute_rollout_stats)
    # ray.remote copied the base class's methods onto the actor class it built; give it the patched ones.
    actor_class = ppo_trainer.PPOTrainer.__ray_metadata__.modified_class
    for name in ("save_logs_and_checkpoints", "_compute_rollout_stats"):
        setattr(actor_class, name, getattr(base_trainer, name))
    logging_utils.WandbLogger.close = _closing_wandb(logging_utils.WandbLogger.close)
    DeepspeedStrategy.save_model = atomic_save_model(DeepspeedStrategy.save_model)
    DeepspeedStrategy.load_ckpt = logging_resume(DeepspeedStrategy.load_ckpt)  # resume line: checkpoint.py
    # create_vllm_engines looks RolloutRayActor up in its module when it runs.
    vllm_engine.RolloutRayActor = _lora_engine_actor(vllm_engine.RolloutRayActor)
    reference_policy.install()  # KL reference = the policy with its adapters disabled (reference_policy.py)
    offload.install()  # LORA_SYNC_OFFLOAD_PARAMS=1: the policy's parameters in pinned host memory
    report_reward_errors()  # a raising reward_func: a warning, a metric, a clear stop (reward_errors.py)
    setattr(trainer_cls, _APPLIED_MARK, True)


def is_applied() -> bool:
    from openrlhf.trainer.ray import ppo_actor

    return getattr(ppo_actor.ActorPPOTrainer, _APPLIED_MARK, False)
