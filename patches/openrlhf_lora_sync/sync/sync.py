"""One weight sync, trainer to engines: plan, gather and merge module by module, bucket, send, reload.

Covers: the sync loop shared by the OpenRLHF patch, verify_sync.py, the tests and the benchmarks;
per-sync statistics (mode, tensors, bytes, buckets, seconds, and where the seconds went: merge (gather
included), pack, transport, engine reload) for logging; /dev/shm buckets pipelined (the engines load
one while the next is merged, through two files kept from sync to sync: transport.ShmSlots); marking
the engines' weights as unknown when a sync fails midway, so the next sync is full and nothing
half-applied is reported as success; resetting the engine caches that would otherwise keep serving
the old policy (prefix cache, multimodal processor cache, encoder cache) through the engine's own calls.
Does not cover: how engines are reached (an `Engines` object supplies rpc and cache resets: in-process
vLLM `LLM`s here, OpenRLHF's Ray engine actors in openrlhf_patch.py).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.sync.bucket import split_groups
from openrlhf_lora_sync.sync.merge import SyncUnit, iter_effective_checkpoint_tensors, sync_units
from openrlhf_lora_sync.sync.plan import DEFAULT_PACKED_MODULES, SyncState
from openrlhf_lora_sync.sync.transport import TRANSPORTS, Send, kept_shm_slots, send_via_shm

# Small enough for the /dev/shm pipeline to overlap the trainer's merge with the engines' reload (128 MiB
# against 512: docs/performance.md, "What made it fast"). Each also bounds the merged tensors held at
# once, and the two kept /dev/shm files.
DEFAULT_BUCKET_BYTES = settings.get("sync.bucket_mb").default << 20


class Engines(Protocol):
    def rpc(self, method: str, *args) -> list: ...

    def rpc_each(self, method: str, per_engine_args: list[tuple]) -> list:
        """Engine i gets per_engine_args[i]; results flattened like rpc's."""

    def __len__(self) -> int: ...

    def reset_caches(self) -> None: ...


class LocalEngines:
    """vLLM `LLM` objects in this process."""

    def __init__(self, *llms) -> None:
        self.llms = llms

    def rpc(self, method: str, *args) -> list:
        return self.rpc_each(method, [args] * len(self.llms))

    def rpc_each(self, method: str, per_engine_args: list[tuple]) -> list:
        return [
            result
            for llm, args in zip(self.llms, per_engine_args, strict=True)
            for result in llm.collective_rpc(method, args=args)
        ]

    def __len__(self) -> int:
        return len(self.llms)

    def reset_caches(self) -> None:
        for llm in self.llms:
            llm.reset_prefix_cache()
            llm.reset_mm_cache()
            llm.llm_engine.reset_encoder_cache()


@dataclass
class SyncStats:
    mode: str
    reason: str
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    # The post-sync probe's numbers when it ran after this sync (probe.ProbeResult.as_metrics), else empty.
    probe: dict[str, float] = field(default_factory=dict)
    # Seconds per stage: merge (gather + LoRA merge + naming), pack (into the transport's buffer),
    # transport (engine RPCs minus the engine's own reload time), reload (the engine loading tensors).
    # With pipelined /dev/shm buckets the engines' part overlaps the trainer's: stages sum to more.
    stages: dict[str, float] = field(default_factory=dict)
    # The transport's name (shm, broadcast, cuda_ipc), set by whoever chose it (openrlhf_patch); None: unset.
    transport: str | None = None

    def as_metrics(self, prefix: str = "sync/") -> dict[str, float]:
        metrics = {
            f"{prefix}full": float(self.mode == "full"),
            f"{prefix}tensors": float(self.tensors),
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}buckets": float(self.buckets),
            f"{prefix}seconds": self.seconds,
        }
        metrics.update({f"{prefix}seconds_{stage}": seconds for stage, seconds in self.stages.items()})
        metrics.update({f"{prefix}{name}": value for name, value in self.probe.items()})
        return metrics

    def __str__(self) -> str:
        over = f" over {self.transport}" if self.transport else ""
        return (
            f"weight sync: {self.mode} ({self.reason}), {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB "
            f"in {self.buckets} buckets{over}, {self.seconds:.2f} s"
        )


def _timed(items: Iterable, stages: dict[str, float], stage: str) -> Iterator:
    """`items`, adding the time spent producing each to stages[stage]."""
    iterator = iter(items)
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            stages[stage] += time.perf_counter() - start
        yield item


def _groups_by_parent(
    model: nn.Module, units: list[SyncUnit], dtype: torch.dtype
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Tensors grouped by parent module, so a fused q/k/v or gate/up group never spans two buckets."""
    merged = iter_effective_checkpoint_tensors(model, units, dtype)
    for _, group in itertools.groupby(merged, key=lambda item: item[0].parent):
        yield [pair for _, tensors in group for pair in tensors.items()]


def _wait_for(loading: Future | None) -> None:
    """Wait for the previous bucket's load, raising its error."""
    if loading is not None:
        loading.result()


def sync_weights(
    model: nn.Module,
    engines: Engines,
    state: SyncState,
    *,
    dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    packed_modules: dict[str, list[str]] | None = None,
    force_full: bool = False,
    send: bool = True,
    transport: str | Send = "shm",
) -> SyncStats:
    """Bring the engines to the policy's current effective weights (full or delta, as `state` decides).

    Under ZeRO-3 every trainer rank must call this (gathering is collective) with the same plan
    inputs and transport; only the rank with send=True talks to the engines."""
    send_bucket = TRANSPORTS[transport] if isinstance(transport, str) else transport
    stages = dict.fromkeys(("merge", "pack", "rpc"), 0.0)

    def rpc(method: str, *args) -> list:
        rpc_start = time.perf_counter()
        try:
            return engines.rpc(method, *args)
        finally:
            stages["rpc"] += time.perf_counter() - rpc_start

    # /dev/shm buckets are pipelined: the engines load bucket k (in a thread) while this thread merges and
    # packs bucket k+1. Only the shm sender qualifies: the others make collective calls, which must not
    # interleave with the gathers of the next bucket. Trainer memory still holds one bucket of merged
    # tensors (a staged bucket lives in its file); /dev/shm holds two, kept for the next sync.
    pipelined = send and send_bucket is send_via_shm
    slots = kept_shm_slots() if pipelined else None
    loading: Future | None = None  # the engines' load of the previous staged bucket
    start = time.perf_counter()
    plan = state.next_plan(sync_units(model), packed_modules or DEFAULT_PACKED_MODULES, force_full)
    tensors = total_bytes = buckets = 0
    reload_seconds = 0.0
    if send:
        rpc("begin_weight_sync")
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="lora-sync-load") as loader:
            merged_groups = _timed(_groups_by_parent(model, plan.units, dtype), stages, "merge")
            for bucket in split_groups(merged_groups, bucket_bytes):
                send_start, rpc_before = time.perf_counter(), stages["rpc"]
                if pipelined:
                    staged = slots.stage(bucket)  # the slot the load in flight does not use
                    nbytes = staged.total
                    stages["pack"] += time.perf_counter() - send_start
                    _wait_for(loading)
                    loading = loader.submit(slots.load, rpc, staged)
                else:
                    nbytes, _ = send_bucket(rpc if send else None, bucket)
                    # What the sender spent outside engine RPCs: packing (and, for broadcast, the collective).
                    stages["pack"] += time.perf_counter() - send_start - (stages["rpc"] - rpc_before)
                total_bytes += nbytes
                tensors += len(bucket)
                buckets += 1
                del bucket  # sent or staged: free its tensors before the next bucket is merged
            _wait_for(loading)
        if send:
            reports = rpc("finish_weight_sync", plan.mode == "full")
            reload_seconds = max(report["load_seconds"] for report in reports)
    except BaseException:
        state.weights_lost("the previous sync failed midway")  # (leaving the pool waited for any load)
        if slots is not None:
            slots.close()  # an engine that failed mid-load may still map them: the next sync makes new ones
        if send:
            with contextlib.suppress(Exception):  # close the engine's reload session; its weights are unknown
                engines.rpc("finish_weight_sync", False)
        raise
    if send:
        engines.reset_caches()
    state.synced()
    stages["transport"] = stages.pop("rpc") - reload_seconds
    stages["reload"] = reload_seconds
    seconds = time.perf_counter() - start
    return SyncStats(plan.mode, plan.reason, tensors, total_bytes, buckets, seconds, stages=stages)
