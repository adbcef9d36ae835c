"""CUDA-IPC handoff of a packed bucket between two processes, with PyTorch expandable segments on and off.

Needs only torch and a CUDA GPU (skipped elsewhere), so it runs on a bare GPU machine. The sender
allocates the bucket through transport.cuda_ipc_bucket, which turns expandable segments off for that
allocation: IPC of expandable-segment memory goes through pidfd_getfd, which ptrace_scope=1 forbids.
With the setting on in the sender's environment the handoff must still work and the setting must be
restored afterwards. The bucket's layout travels as plain tuples, as through vLLM's RPC (its wire forms:
tests/unit/test_bucket.py).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch


def _tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(64, 32, generator=generator).to(torch.bfloat16)),
        ("a.bias", torch.randn(64, generator=generator)),
        ("b.weight", torch.randn(3, 5, 7, generator=generator).to(torch.float16)),
    ]


def _receiver(queue_in, queue_out) -> None:
    from openrlhf_lora_sync.sync.bucket import unpack
    from openrlhf_lora_sync.sync.transport import open_cuda_ipc_bucket

    handle, metas = queue_in.get()
    buffer = open_cuda_ipc_bucket(handle, torch.cuda.current_device())
    queue_out.put([(name, tensor.cpu().clone()) for name, tensor in unpack(buffer, metas)])


def _sender(alloc_conf: str, result) -> None:
    import os

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    from openrlhf_lora_sync.sync.transport import _expandable_segments_enabled, cuda_ipc_bucket

    context = mp.get_context("spawn")
    to_receiver, from_receiver = context.Queue(), context.Queue()
    receiver = context.Process(target=_receiver, args=(to_receiver, from_receiver))
    receiver.start()
    named = [(name, tensor.cuda()) for name, tensor in _tensors()]
    buffer, metas, handle = cuda_ipc_bucket(named, torch.device("cuda", 0))
    to_receiver.put((handle, [tuple(meta) for meta in metas]))
    received = from_receiver.get(timeout=120)
    receiver.join(timeout=60)
    del buffer
    result.put((received, _expandable_segments_enabled()))


@pytest.mark.gpu
@pytest.mark.parametrize("alloc_conf", ["expandable_segments:True", "expandable_segments:False"])
def test_bucket_crosses_processes_over_cuda_ipc(alloc_conf):
    context = mp.get_context("spawn")
    result = context.Queue()
    sender = context.Process(target=_sender, args=(alloc_conf, result))
    sender.start()
    received, setting_after = result.get(timeout=300)
    sender.join(timeout=60)
    assert sender.exitcode == 0
    assert [name for name, _ in received] == [name for name, _ in _tensors()]
    for (_, got), (_, want) in zip(received, _tensors(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert setting_after == (alloc_conf == "expandable_segments:True")
