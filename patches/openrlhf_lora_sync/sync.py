"""One weight sync, trainer to engines: plan, gather and merge module by module, bucket, send, reload.

Covers: the sync loop shared by the OpenRLHF patch, verify_sync.py, the tests and the benchmarks;
per-sync statistics (mode, tensors, bytes, buckets, seconds) for logging; marking the engines'
weights as unknown when a sync fails midway, so the next sync is full and nothing half-applied is
reported as success; resetting the engine caches that would otherwise keep serving the old policy
(prefix cache, multimodal processor cache, encoder cache) through the engine's own calls.
Does not cover: how engines are reached (an `Engines` object supplies rpc and cache resets: in-process
vLLM `LLM`s here, OpenRLHF's Ray engine actors in openrlhf_patch.py).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from openrlhf_lora_sync.bucket import split_groups
from openrlhf_lora_sync.merge import SyncUnit, iter_effective_checkpoint_tensors, sync_units
from openrlhf_lora_sync.plan import DEFAULT_PACKED_MODULES, SyncState
from openrlhf_lora_sync.transport import TRANSPORTS

DEFAULT_BUCKET_BYTES = 512 << 20


class Engines(Protocol):
    def rpc(self, method: str, *args) -> list: ...

    def reset_caches(self) -> None: ...


class LocalEngines:
    """vLLM `LLM` objects in this process."""

    def __init__(self, *llms) -> None:
        self.llms = llms

    def rpc(self, method: str, *args) -> list:
        return [result for llm in self.llms for result in llm.collective_rpc(method, args=args)]

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
    # Filled in when the post-sync probe ran after this sync (probe.py); None otherwise.
    probe_max_abs_diff: float | None = None
    probe_mean_abs_diff: float | None = None
    probe_seconds: float | None = None

    def as_metrics(self, prefix: str = "sync/") -> dict[str, float]:
        metrics = {
            f"{prefix}full": float(self.mode == "full"),
            f"{prefix}tensors": float(self.tensors),
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}buckets": float(self.buckets),
            f"{prefix}seconds": self.seconds,
        }
        if self.probe_max_abs_diff is not None:
            metrics[f"{prefix}probe_max_abs_diff"] = self.probe_max_abs_diff
            metrics[f"{prefix}probe_mean_abs_diff"] = self.probe_mean_abs_diff
            metrics[f"{prefix}probe_seconds"] = self.probe_seconds
        return metrics

    def __str__(self) -> str:
        return (
            f"weight sync: {self.mode} ({self.reason}), {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB "
            f"in {self.buckets} buckets, {self.seconds:.2f} s"
        )


def _groups_by_parent(
    model: nn.Module, units: list[SyncUnit], dtype: torch.dtype
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Tensors grouped by parent module, so a fused q/k/v or gate/up group never spans two buckets."""
    merged = iter_effective_checkpoint_tensors(model, units, dtype)
    for _, group in itertools.groupby(merged, key=lambda item: item[0].parent):
        yield [pair for _, tensors in group for pair in tensors.items()]


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
    transport: str = "shm",
) -> SyncStats:
    """Bring the engines to the policy's current effective weights (full or delta, as `state` decides).

    Under ZeRO-3 every trainer rank must call this (gathering is collective) with the same plan
    inputs and transport; only the rank with send=True talks to the engines."""
    send_bucket = TRANSPORTS[transport]
    rpc = engines.rpc if send else None
    start = time.perf_counter()
    plan = state.next_plan(sync_units(model), packed_modules or DEFAULT_PACKED_MODULES, force_full)
    tensors = total_bytes = buckets = 0
    if send:
        engines.rpc("begin_weight_sync")
    try:
        for bucket in split_groups(_groups_by_parent(model, plan.units, dtype), bucket_bytes):
            nbytes, _ = send_bucket(rpc, bucket)
            total_bytes += nbytes
            tensors += len(bucket)
            buckets += 1
        if send:
            engines.rpc("finish_weight_sync", plan.mode == "full")
    except BaseException:
        state.weights_lost("the previous sync failed midway")
        if send:
            with contextlib.suppress(Exception):  # close the engine's reload session; its weights are unknown
                engines.rpc("finish_weight_sync", False)
        raise
    if send:
        engines.reset_caches()
    state.synced()
    return SyncStats(plan.mode, plan.reason, tensors, total_bytes, buckets, time.perf_counter() - start)
