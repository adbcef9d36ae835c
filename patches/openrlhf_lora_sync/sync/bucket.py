"""Buckets: many tensors packed into one flat byte buffer, so a sync is a few transfers, not one per tensor.

Covers: packing named tensors (any dtype/shape) into a contiguous uint8 buffer with per-tensor
metadata, unpacking views from such a buffer, and splitting a sequence of tensor groups into buckets
of bounded size without splitting a group (a fused q/k/v or gate/up group split across two in-place
reloads would be processed half-loaded by vLLM and corrupt the engine).
Does not cover: moving the buffer between processes (transport.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

# Offsets are aligned so every unpacked view is aligned for its dtype (and for vectorized copies).
ALIGNMENT = 64


class TensorMeta(NamedTuple):
    """Where one tensor lies in a bucket. A plain tuple on the wire: vLLM's multiprocess RPC turns
    dataclasses into dicts, tuples stay sequences, so receivers rebuild it with TensorMeta(*fields)."""

    name: str
    dtype: str  # e.g. "bfloat16": plain data, picklable across any RPC
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    metas, offset = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(
            TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes)
        )
        offset = _aligned(offset + nbytes)
    return metas, offset


def pack_into(buffer: torch.Tensor, named: list[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> None:
    for (_, tensor), meta in zip(named, metas, strict=True):
        view = buffer[meta.offset : meta.offset + meta.nbytes]
        view.copy_(tensor.contiguous().reshape(-1).view(torch.uint8))


def unpack(buffer: torch.Tensor, metas: Iterable[Sequence]) -> list[tuple[str, torch.Tensor]]:
    """Views into `buffer` (no copy): valid while the buffer is."""
    metas = [TensorMeta(*meta) for meta in metas]
    return [
        (
            meta.name,
            buffer[meta.offset : meta.offset + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape),
        )
        for meta in metas
    ]


def split_groups(
    groups: Iterable[list[tuple[str, torch.Tensor]]], limit_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Concatenate groups into buckets of at most limit_bytes; a group larger than that is a bucket alone."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for group in groups:
        group_size = sum(_aligned(t.numel() * t.element_size()) for _, t in group)
        if bucket and size + group_size > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(group)
        size += group_size
    if bucket:
        yield bucket
