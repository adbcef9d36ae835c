"""The run-time patch of OpenRLHF 0.11.2: LoRA-aware merge-then-sync in place of `broadcast_to_vllm`.

Covers: `apply()` and what it installs, listed in `_parts()` with one line each, the fix first (the
trainer's sync, `lora_broadcast_to_vllm`; the engine actor that receives it; at vLLM sleep level 2 a sync
before the first rollout), then the further parts (checks, metrics, saves, the reference policy, offload,
CPU stand-ins). `apply()` is idempotent and runs
in the driver (launch.py) and in every Ray worker, nested ones too (Ray's `worker_process_setup_hook`);
vLLM's engine-core process gets the worker extension by import name from the patched engine actor.
Does not cover: the sync itself (sync/: merge, plan, bucket, transport, worker_extension, probe), or
OpenRLHF/vLLM releases other than the pinned ones, which `apply()` refuses. Reading order: docs/sync.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.base.pins import check_versions
from openrlhf_lora_sync.patch import cpu_standins, run_metrics
from openrlhf_lora_sync.patch.run_metrics import (  # noqa: F401 (also imported from here: tools, tests)
    METRICS_FILE,
    GenKLGateExceeded,
    gen_kl_gate,
    never_sampled_token_ids,
    rollout_parity,
    rollout_sampling,
)

logger = logging.getLogger("openrlhf_lora_sync")
logger.setLevel(logging.INFO)  # the per-sync summary is INFO; apply() gives it a handler

_APPLIED_MARK = "_openrlhf_lora_sync_patched"

# The fix, trainer side: ActorPPOTrainer.broadcast_to_vllm replaced (and PPOTrainer.fit at sleep level 2). --


def lora_broadcast_to_vllm(self) -> None:
    """Replacement for ActorPPOTrainer.broadcast_to_vllm (runs on every trainer rank): the policy's
    effective weights into the engines, full or delta as the engines' state requires (sync/sync.py), in
    the engine dtype, under HF names; then the post-sync probe. One summary line per sync (rank 0)."""
    import torch

    state = _sync_state(self)
    if _skipped_by_stale_engine_control(self):
        return
    if sleep_level() == 2:
        state.weights_lost("vLLM sleep level 2 discarded the engine's weights")
    distributed = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    engines = RayEngines(self.vllm_engines)
    transport_name, transport = _transport(self, engines, rank, distributed)
    packed = _asked_once(
        self, "_lora_sync_packed", lambda: engines.rpc("packed_modules_mapping")[0], rank, distributed
    )
    sync, mode_kwargs = _sync_for_mode(state)
    _calibrate_probe_before_first_sync(self, engines, rank, distributed)
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
    _probe_if_due(self, engines, state, stats, rank, distributed)
    if rank == 0:
        logger.info("%s", stats)
    self._lora_sync_last_stats = stats
    if distributed:
        torch.distributed.barrier()


def _sync_state(trainer):
    """What the trainer knows of the engines' weights (plan.SyncState; adapter mode's AdapterSyncState)."""
    from openrlhf_lora_sync.sync.adapter_mode import AdapterSyncState
    from openrlhf_lora_sync.sync.plan import SyncState

    if getattr(trainer, "_lora_sync_state", None) is None:
        trainer._lora_sync_state = AdapterSyncState() if sync_mode() == "adapter" else SyncState()
    return trainer._lora_sync_state


def _sync_for_mode(state) -> tuple[Callable, dict]:
    """The mode (sync.mode): merge sends merged weights (sync.sync_weights: full or delta); adapter sends
    the adapter every time and the base only when the engines lost it (adapter_mode.sync_adapter)."""
    from openrlhf_lora_sync.sync.adapter_mode import sync_adapter
    from openrlhf_lora_sync.sync.sync import sync_weights

    force_full = settings.read("sync.force_full")
    if sync_mode() != "adapter":
        return sync_weights, {"force_full": force_full}
    if force_full:
        state.weights_lost("forced")
    return sync_adapter, {}


def _skipped_by_stale_engine_control(trainer) -> bool:
    """A control (sync.stale_engine_control): every sync after the first is skipped, so the engines keep
    the first sync's policy (the CPU run's never-synced control run)."""
    import torch

    if not settings.read("sync.stale_engine_control") or getattr(trainer, "_lora_sync_count", 0) == 0:
        return False
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.info(
            "weight sync: skipped (sync.stale_engine_control: the engines keep the first sync's policy)"
        )
    trainer._lora_sync_last_stats = None
    return True


def _transport(trainer, engines, rank: int, distributed: bool):
    """(name, what sync() takes) for the transport sync.transport names, auto resolved by where the
    engines are (sync_transport); the broadcast's process group is made at the first sync and kept."""
    # Rank 0's Ray node id and the engines': engines on another node get the broadcast transport.
    trainer_node, engine_nodes = _asked_once(
        trainer, "_lora_sync_nodes", lambda: _sync_nodes(engines), rank, distributed
    )
    name = sync_transport(trainer.strategy.args.train.colocate_all, trainer_node, engine_nodes)
    if name != "broadcast":
        return name, name
    if getattr(trainer, "_lora_sync_broadcast", None) is None:
        from openrlhf_lora_sync.sync.transport import BroadcastTransport

        trainer._lora_sync_broadcast = BroadcastTransport(
            engines, trainer.strategy.args.vllm.tensor_parallel_size
        )
    return name, trainer._lora_sync_broadcast


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


def _synced_before_first_rollout(upstream_fit):
    """PPOTrainer.fit, with a sync into the engines before the first rollout at vLLM sleep level 2.

    create_vllm_engines puts the engines to sleep right after they load the checkpoint, and level 2 frees
    the weights instead of offloading them: woken for the first rollout they hold garbage until the first
    sync, which upstream runs after the first training step. A resumed fit syncs before its first rollout
    already (upstream, on the same condition as here): nothing is added then. At level 2 every sync is
    full (lora_broadcast_to_vllm); levels 0 and 1 keep the checkpoint, and nothing changes there."""

    def fit(self, global_step: int = 0) -> None:
        level_2 = self.vllm_engines and self.args.vllm.enable_sleep and sleep_level() == 2
        if level_2 and not (global_step or self.init_checkpoint_states()["global_step"] > 0):
            self.broadcast_to_vllm()
        return upstream_fit(self, global_step)

    return fit


# The fix, engine side: OpenRLHF's engine actor loads this package's worker extension. ----------------


def _lora_engine_actor(upstream_actor):
    """A Ray actor class: OpenRLHF's engine actor plus what the sync needs (the worker extension,
    lora_sync_rpc, reset_all_caches, node_id) and three riders: sleep at sync.vllm_sleep_level, adapter
    mode's LoRA engine, and rollout_sampling. Methods must exist when `ray.remote` builds the class (actor
    handles only expose those), hence a subclass, not attributes added to the upstream class afterwards."""
    import ray

    from openrlhf_lora_sync.sync.worker_extension import WORKER_EXTENSION_CLS

    upstream = upstream_actor.__ray_metadata__.modified_class.__bases__[0]

    class LoraSyncRolloutRayActor(upstream):
        async def __init__(self, *args, **kwargs):
            kwargs["worker_extension_cls"] = WORKER_EXTENSION_CLS  # the fix: begin/load/finish_weight_sync
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

        # The fix: the trainer's RPCs into the workers, and the cache resets after a sync.
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

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        # Riders: the sleep level the sync plans for (none on CPU), and the rollouts' sampling parameters.
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

    LoraSyncRolloutRayActor.__qualname__ = LoraSyncRolloutRayActor.__name__ = "RolloutRayActor"
    return ray.remote(LoraSyncRolloutRayActor)


# A control: the post-sync probe (sync/probe.py), its floor measured before the first sync. ----------


def _calibrate_probe_before_first_sync(trainer, engines, rank: int, distributed: bool) -> None:
    """Before the first sync the engines still hold the checkpoint: the probe's noise floor, once a run
    (not at sleep level 2, which discarded the checkpoint: the first sync's reading is the floor then)."""
    first = getattr(trainer, "_lora_sync_count", 0) == 0
    if settings.read("sync.probe_every") > 0 and first and sleep_level() != 2:
        trainer._lora_sync_probe_floor = _calibrate_probe(trainer, engines, rank, distributed)


def _probe_if_due(trainer, engines, state, stats, rank: int, distributed: bool) -> None:
    """The probe after every sync.probe_every-th sync; a failed probe makes the next sync full."""
    from openrlhf_lora_sync.sync import probe

    every = settings.read("sync.probe_every")
    if every <= 0 or trainer._lora_sync_count % every:
        return
    try:
        _probe_after_sync(trainer, engines, stats, rank, distributed)
    except probe.ProbeFailed:
        # Whoever catches this and goes on gets a full resync next time, not a delta onto bad weights.
        state.weights_lost("the post-sync probe failed")
        raise


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


# Further parts (apply()'s _parts() after the fix). ----------------------------------------------------


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


def _enter_run_workdir() -> None:
    """Work in the launcher's directory (LORA_SYNC_WORKDIR), where this host has it: Ray starts workers in
    the directory its node was started from, and OpenRLHF opens the data's relative image paths in the
    engine actors. Nothing without the variable (tests, processes not started by the launcher)."""
    import os

    workdir = settings.read("LORA_SYNC_WORKDIR")
    if workdir and os.path.isdir(workdir) and os.path.realpath(os.getcwd()) != os.path.realpath(workdir):
        os.chdir(workdir)


@dataclasses.dataclass(frozen=True)
class Part:
    """One change apply() makes to OpenRLHF: `name`, the upstream code it changes and why, how."""

    name: str
    changes: str  # the upstream code it changes
    why: str
    install: Callable[[], None]


def _wrap(owner, attribute: str, wrapper) -> None:
    setattr(owner, attribute, wrapper(getattr(owner, attribute)))


def _parts() -> tuple[Part, ...]:
    """What apply() installs, in order: the fix first (the sync and its engine side), then the further
    parts, each independent of the fix and of the others."""
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import ppo_actor, vllm_engine
    from openrlhf.utils import logging_utils
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    from openrlhf_lora_sync.patch import checkpoint, offload, reference_policy, reward_errors

    trainer, base_trainer = ppo_actor.ActorPPOTrainer, ppo_trainer.BasePPOTrainer
    # ray.remote copied BasePPOTrainer's methods onto the PPOTrainer actor class it built: patch both.
    ppo_trainer_actor = ppo_trainer.PPOTrainer.__ray_metadata__.modified_class

    def wrap_base_trainer(attribute: str, wrapper) -> Callable[[], None]:
        def install() -> None:
            _wrap(base_trainer, attribute, wrapper)
            setattr(ppo_trainer_actor, attribute, getattr(base_trainer, attribute))

        return install

    def replace_sync() -> None:
        # Upstream's own sync stays callable (tools/bench_trainer_sync.py times it against the patch's).
        trainer.upstream_broadcast_to_vllm = trainer.broadcast_to_vllm
        trainer.broadcast_to_vllm = lora_broadcast_to_vllm

    return (
        # The fix: the trainer's sync, the engine side it talks to, and at sleep level 2 a first sync.
        Part(
            "sync",
            "ActorPPOTrainer.broadcast_to_vllm -> lora_broadcast_to_vllm",
            "upstream sends fp32 adapters under peft names (VLMs: adapters only) over CUDA IPC, which the "
            "bf16 engine cannot load and ptrace_scope=1 forbids; this sends merged bf16 weights, HF names",
            replace_sync,
        ),
        Part(
            "engine_actor",
            "vllm_engine.RolloutRayActor (looked up by create_vllm_engines when it runs)",
            "the sync's engine side: loads LoraSyncWorkerExtension instead of WorkerWrap, adds the sync's "
            "RPC and cache resets; sleeps at sync.vllm_sleep_level; adapter mode; rollout_sampling",
            lambda: _wrap(vllm_engine, "RolloutRayActor", _lora_engine_actor),
        ),
        Part(
            "sleep2_first_rollout",
            "PPOTrainer.fit",
            "at vLLM sleep level 2 the engines' first sleep discards the checkpoint and upstream syncs only "
            "after a training step: a full sync before the first rollout",
            lambda: _wrap(ppo_trainer_actor, "fit", _synced_before_first_rollout),
        ),
        # Further parts: each optional, none needed by the fix.
        Part(
            "adapter_checks",
            "ActorPPOTrainer.__init__",
            "refuses adapters the sync cannot merge (or adapter mode cannot serve) before the first rollout",
            lambda: _wrap(trainer, "__init__", _checking_adapters_at_start),
        ),
        Part(
            "sync_metrics",
            "ActorPPOTrainer.ppo_train",
            "its status, which OpenRLHF logs, carries the last sync's sync/* numbers",
            lambda: _wrap(trainer, "ppo_train", _with_sync_metrics),
        ),
        Part(
            "metrics_file",
            "BasePPOTrainer.save_logs_and_checkpoints",
            "also appends each logged step to <ckpt.output_dir>/metrics/steps.jsonl, with or without wandb",
            wrap_base_trainer("save_logs_and_checkpoints", run_metrics.recording_metrics),
        ),
        Part(
            "rollout_parity",
            "BasePPOTrainer._compute_rollout_stats",
            "adds parity/* (engine vs trainer log-probs of the sampled tokens) and the sync.gen_kl_gate",
            wrap_base_trainer("_compute_rollout_stats", run_metrics.with_rollout_parity),
        ),
        Part(
            "wandb_teardown",
            "WandbLogger.close",
            "then wandb.teardown(): no 'Connection lost' traceback when Ray ends the trainer actor",
            lambda: _wrap(logging_utils.WandbLogger, "close", run_metrics.closing_wandb),
        ),
        Part(
            "atomic_saves",
            "DeepspeedStrategy.save_model",
            "writes into a staging directory renamed over the target: an interrupted save keeps the old one",
            lambda: _wrap(DeepspeedStrategy, "save_model", checkpoint.atomic_save_model),
        ),
        Part(
            "resume_log",
            "DeepspeedStrategy.load_ckpt",
            "one line saying what a resume loaded (checkpoint.py)",
            lambda: _wrap(DeepspeedStrategy, "load_ckpt", checkpoint.logging_resume),
        ),
        Part(
            "reference_policy",
            "the reference model group, RemoteExperienceMaker, PolicyModelActor",
            "no reference model: the KL reference is the policy with its adapters disabled",
            reference_policy.install,
        ),
        Part(
            "offload",
            "Actor.__init__, DeepspeedStrategy's ZeRO-3 config",
            "with LORA_SYNC_OFFLOAD_PARAMS=1 the policy's parameters and optimizer in pinned host memory",
            offload.install,
        ),
        Part(
            "reward_errors",
            "SingleTurnAgentExecutor, SamplesGenerator",
            "a raising reward_func: a warning, a metric, a clear stop (reward_errors.py)",
            reward_errors.install,
        ),
        Part(
            "cpu_standins",
            "torch.cuda calls OpenRLHF makes unconditionally, without CUDA only",
            "lets the real train_ppo_ray run on CPU (cpu_standins.STAND_INS names each call site)",
            cpu_standins.install,
        ),
    )


def apply() -> None:
    """Patch OpenRLHF in this process (idempotent): each of _parts(), the fix first. Raises
    UnsupportedVersionError on other releases."""
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.utils.logging_utils import init_logger

    if getattr(ppo_actor.ActorPPOTrainer, _APPLIED_MARK, False):
        return
    check_versions()
    _enter_run_workdir()
    # OpenRLHF's own handler (INFO, stdout, its format): the one summary line per sync is in the run's log
    # at INFO, next to OpenRLHF's lines, and warnings stay for what needs action.
    init_logger(logger.name)
    for part in _parts():
        part.install()
    setattr(ppo_actor.ActorPPOTrainer, _APPLIED_MARK, True)


def is_applied() -> bool:
    from openrlhf.trainer.ray import ppo_actor

    return getattr(ppo_actor.ActorPPOTrainer, _APPLIED_MARK, False)
