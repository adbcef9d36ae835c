"""Moving a packed bucket from a trainer process to the vLLM workers.

Transports (the worker side of each is in worker_extension.py):
- "shm": the bucket is written to a file under /dev/shm and the workers map it. Needs neither ptrace
  permission nor NCCL, works across process boundaries on one node, and is the only one that runs on CPU.
- "cuda_ipc": for engines colocated on the trainer's GPUs. The bucket is allocated with PyTorch's
  expandable segments off: IPC of expandable-segment memory is what calls `pidfd_getfd`, which
  Ubuntu's default `kernel.yama.ptrace_scope=1` (and Docker without CAP_SYS_PTRACE) forbids. Plain
  cudaMalloc memory is shared with cudaIpcGetMemHandle, which needs no ptrace permission.
Each `send_via_*` takes (rpc or None, named tensors) and is called on every trainer rank; the rank
holding the rpc talks to the engines. TRANSPORTS maps the names recipes use to them.
Does not cover: NCCL to engines on other GPUs (not colocated runs keep OpenRLHF's own path).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Callable

import torch

from openrlhf_lora_sync.bucket import TensorMeta, layout, pack_into

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

# rpc(method_name, *args) -> list of per-engine results; supplied by the caller (in-process LLMs, Ray actors).
Rpc = Callable[..., list]


def send_via_shm(rpc: Rpc | None, named: list[tuple[str, torch.Tensor]]) -> tuple[int, list]:
    """Write the bucket to a /dev/shm file, have every engine load it, remove the file. (bytes, results)
    Only the sending rank calls it (rpc given); other ranks have nothing to do."""
    metas, total = layout(named)
    if rpc is None:
        return total, []
    path = os.path.join(SHM_DIR, f"openrlhf-lora-sync-{os.getpid()}-{uuid.uuid4().hex}.bin")
    try:
        buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        pack_into(buffer, named, metas)
        del buffer  # unmaps; the file keeps the bytes
        results = rpc("load_bucket_from_file", path, total, [tuple(meta) for meta in metas])
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return total, results


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


TRANSPORTS = {"shm": send_via_shm, "cuda_ipc": send_via_cuda_ipc}
