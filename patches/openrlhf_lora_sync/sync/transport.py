"""Moving a packed bucket from a trainer process to the vLLM workers.

Transports (the worker side of each is in worker_extension.py):
- "shm": the bucket is written to a file under /dev/shm and the workers map it. Needs neither ptrace
  permission nor NCCL, works across process boundaries on one node, and is the only one that runs on CPU.
  sync.py pipelines it through two files reused bucket after bucket and sync after sync (ShmSlots).
- "cuda_ipc": for engines colocated on the trainer's GPUs. The bucket is allocated with PyTorch's
  expandable segments off: IPC of expandable-segment memory is what calls `pidfd_getfd`, which
  Ubuntu's default `kernel.yama.ptrace_scope=1` (and Docker without CAP_SYS_PTRACE) forbids. Plain
  cudaMalloc memory is shared with cudaIpcGetMemHandle, which needs no ptrace permission.
- "broadcast": for engines that do not share the trainer's GPUs, on this node or others. Trainer rank 0
  and every engine worker join one process group of their own (vLLM's stateless group: it leaves both
  sides' default groups alone), NCCL on GPUs and gloo on CPU; each bucket is broadcast from rank 0.
Each sender takes (rpc or None, named tensors) and is called on every trainer rank; the rank holding
the rpc talks to the engines. TRANSPORTS maps the names recipes use to the stateless ones;
`BroadcastTransport` keeps its process group and is built per run.
Does not cover: choosing among them (openrlhf_patch.sync_transport).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import os
import socket
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from openrlhf_lora_sync.base import settings
from openrlhf_lora_sync.sync.bucket import TensorMeta, layout, pack_into

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# Bucket files are named openrlhf-lora-sync-<run>-<pid>-<random>.bin; the launcher sets the run id (and
# Ray forwards it to every actor) and removes the run's files when training ends, however it ends.
SHM_FILE_PREFIX = "openrlhf-lora-sync-"
RUN_ID_ENV = settings.get("LORA_SYNC_RUN_ID").env

# rpc(method_name, *args) -> list of per-engine results; supplied by the caller (in-process LLMs, Ray actors).
Rpc = Callable[..., list]
# send(rpc or None, named tensors) -> (bytes, per-worker results): one bucket to every engine.
Send = Callable[[Rpc | None, list[tuple[str, torch.Tensor]]], tuple[int, list]]


class ShmBucket(NamedTuple):
    """A packed bucket in a /dev/shm file, written and not yet loaded."""

    path: str
    total: int
    metas: list[TensorMeta]


class ShmSlots:
    """/dev/shm files that carry bucket after bucket, each reused once the engines have loaded from it.

    Why reuse: tmpfs allocates and zeroes a page the first time it is written, so a new file per bucket
    pays that for every byte sent (most of the packing time: docs/performance.md, "What made it fast").
    A slot is retired instead (its file unlinked, a new
    one made) when an engine reports that it still holds views into the file after the load: vLLM's
    layerwise reload keeps the received tensors of a layer it cannot process yet (one whose parameter is
    padded beyond the checkpoint's shape, attention scales) until finalize, and overwriting the file would
    change them. An unlinked file lives on while mapped. close() removes the files."""

    def __init__(self, count: int) -> None:
        self._paths = [self._new_path() for _ in range(count)]
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._next = 0

    @staticmethod
    def _new_path() -> str:
        run = settings.read(RUN_ID_ENV)
        return os.path.join(SHM_DIR, f"{SHM_FILE_PREFIX}{run}-{os.getpid()}-{uuid.uuid4().hex}.bin")

    def stage(self, named: list[tuple[str, torch.Tensor]]) -> ShmBucket:
        """Pack the bucket into the next slot (the caller has waited for that slot's previous load)."""
        index = self._next
        self._next = (index + 1) % len(self._paths)
        metas, total = layout(named)
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < total:
            self._buffers[index] = None  # unmapped before the file grows
            buffer = torch.from_file(self._paths[index], shared=True, size=total, dtype=torch.uint8)
            self._buffers[index] = buffer
        pack_into(buffer, named, metas)
        return ShmBucket(self._paths[index], total, metas)

    def load(self, rpc: Rpc, bucket: ShmBucket) -> list:
        """Have every engine load a staged bucket; retire its slot if any engine still holds the file."""
        metas = [tuple(meta) for meta in bucket.metas]
        results = rpc("load_bucket_from_file", bucket.path, bucket.total, metas)
        if any(result["holds_file"] for result in results):
            self._retire(self._paths.index(bucket.path))
        return results

    def _retire(self, index: int) -> None:
        self._buffers[index] = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._paths[index])
        self._paths[index] = self._new_path()

    def close(self) -> None:
        for index in range(len(self._paths)):
            self._retire(index)

    def __enter__(self) -> ShmSlots:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@functools.cache
def _kept_shm_slots(pid: int) -> ShmSlots:
    slots = ShmSlots(2)
    atexit.register(slots.close)
    return slots


def kept_shm_slots() -> ShmSlots:
    """This process's two pipelining slots, kept from sync to sync, so that only the first sync pays for
    their pages; /dev/shm holds them (up to two buckets) until the process exits, or until a sync fails and
    closes them (the next one makes new files). Ray may end actors without running exit handlers: the
    launcher's remove_run_files catches what they leave."""
    return _kept_shm_slots(os.getpid())  # per pid: a forked child must not write its parent's files


def remove_run_files(run_id: str) -> None:
    """Remove the bucket files of run `run_id` under /dev/shm on this node."""
    for path in glob.glob(os.path.join(SHM_DIR, f"{SHM_FILE_PREFIX}{glob.escape(run_id)}-*.bin")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def send_via_shm(rpc: Rpc | None, named: list[tuple[str, torch.Tensor]]) -> tuple[int, list]:
    """Write the bucket to a /dev/shm file, have every engine load it, remove the file. (bytes, results)
    Only the sending rank calls it (rpc given); other ranks have nothing to do."""
    if rpc is None:
        return layout(named)[1], []
    with ShmSlots(1) as slot:
        bucket = slot.stage(named)
        return bucket.total, slot.load(rpc, bucket)


def read_shm_bucket(path: str, total: int) -> torch.Tensor:
    """Worker side: map the bucket file privately (copy-on-write, no copy up front)."""
    return torch.from_file(path, shared=False, size=total, dtype=torch.uint8)


def _expandable_segments_enabled() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


@contextlib.contextmanager
def expandable_segments_off():
    """Allocate with plain cudaMalloc inside the block, restoring the process's setting after."""
    was_on = _expandable_segments_enabled()
    if was_on:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if was_on:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def cuda_ipc_bucket(
    named: list[tuple[str, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, list[TensorMeta], tuple]:
    """Pack on the GPU into IPC-shareable memory; returns (buffer, metas, IPC handle). Keep the buffer alive
    until every receiver has loaded it."""
    from torch.multiprocessing.reductions import reduce_tensor

    metas, total = layout(named)
    with expandable_segments_off():
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    pack_into(buffer, named, metas)
    torch.cuda.current_stream(device).synchronize()
    return buffer, metas, reduce_tensor(buffer)


def send_via_cuda_ipc(rpc: Rpc | None, named: list[tuple[str, torch.Tensor]]) -> tuple[int, list]:
    """Collective over the trainer ranks (each shares its GPU with an engine worker): every rank packs the
    bucket on its own GPU, the IPC handles are all-gathered keyed by physical GPU id, and the rank given
    an rpc (rank 0) asks every engine worker to load the handle of its GPU. Buffers stay alive until
    all workers have loaded (the barrier)."""
    from openrlhf.trainer.ray.utils import get_physical_gpu_id

    device = torch.device("cuda", torch.cuda.current_device())
    buffer, metas, handle = cuda_ipc_bucket([(n, t.to(device)) for n, t in named], device)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {get_physical_gpu_id(): handle})
    handles = {gpu: h for per_rank in gathered for gpu, h in per_rank.items()}
    results = rpc("load_bucket_cuda_ipc", handles, [tuple(meta) for meta in metas]) if rpc else []
    torch.distributed.barrier()
    del buffer
    return sum(meta.nbytes for meta in metas), results


def open_cuda_ipc_bucket(handle: tuple, device_index: int) -> torch.Tensor:
    """Worker side: rebuild the sender's buffer on this worker's device from its IPC handle."""
    rebuild, args = handle
    args = list(args)
    args[6] = device_index  # the device ordinal as this process numbers it (CUDA_VISIBLE_DEVICES differ)
    return rebuild(*args)


# The stateless senders by their settings.TRANSPORTS name (the broadcast keeps a group: BroadcastTransport).
TRANSPORTS = {"shm": send_via_shm, "cuda_ipc": send_via_cuda_ipc}


class BroadcastTransport:
    """Sends buckets by broadcast over a process group of trainer rank 0 and all engine workers (world rank
    1 + i * workers_per_engine + worker rank for engine i). The group is formed at the first bucket and
    dropped when a bucket fails, so the next sync forms a new one."""

    def __init__(self, engines, workers_per_engine: int = 1, host: str | None = None) -> None:
        self.engines = engines
        self.workers_per_engine = workers_per_engine
        self.host = host or _node_address()
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        self.group = None

    def _connect(self) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        count = len(self.engines)
        world_size = 1 + count * self.workers_per_engine
        port = free_port()
        joins = [
            (self.host, port, 1 + i * self.workers_per_engine, world_size, self.backend) for i in range(count)
        ]
        # Every member blocks in the rendezvous until all have arrived: the engines join from a thread.
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(self.engines.rpc_each, "join_broadcast_group", joins)
            group = stateless_init_torch_distributed_process_group(
                self.host, port, 0, world_size, self.backend
            )
            joined.result()
        self.group = group

    def __call__(self, rpc: Rpc | None, named: list[tuple[str, torch.Tensor]]) -> tuple[int, list]:
        return self.send(rpc, named, "load_bucket_broadcast")

    def send(
        self, rpc: Rpc | None, named: list[tuple[str, torch.Tensor]], method: str, *method_args
    ) -> tuple[int, list]:
        """Broadcast the bucket while the workers run `method(total, metas, *method_args)`, which receives
        it (worker_extension: load_bucket_broadcast, install_lora_adapter_broadcast)."""
        metas, total = layout(named)
        if rpc is None:
            return total, []
        if self.group is None:
            self._connect()
        buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        pack_into(buffer, named, metas)
        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(rpc, method, total, [tuple(meta) for meta in metas], *method_args)
            sent = self.group.broadcast(buffer, root=0)
            try:
                results = receiving.result()
            except BaseException:
                self.group = None  # a receiver left mid-broadcast: this group's state is unknown
                raise
            sent.wait()
        return total, results


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def free_port() -> int:
    """A TCP port free on every interface of this host (the OS picks it), for a rendezvous."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
