"""Bucket splitting and packing (bucket.py) as pure functions: no model, no engine.

Covers: split_groups keeps order, respects the limit and never splits a group (a fused q/k/v or gate/up
group split across two reloads corrupts the engine), a group larger than the limit travels alone, no
groups make no bucket; pack_into/unpack round-trip tensors of mixed dtypes and shapes at aligned offsets,
with the layout as tuples or serialized lists (how vLLM's RPC carries it), never as dicts.
Does not cover: which groups a sync builds (tests/unit/test_plan.py, tests/sync/test_sync.py) or transport.
"""

from __future__ import annotations

import json

import pytest
import torch
from openrlhf_lora_sync.sync.bucket import ALIGNMENT, layout, pack_into, split_groups, unpack


def _groups(count: int, members: int = 3, nbytes: int = 256) -> list[list[tuple[str, torch.Tensor]]]:
    return [
        [(f"g{g}.t{t}", torch.zeros(nbytes, dtype=torch.uint8)) for t in range(members)] for g in range(count)
    ]


def test_buckets_respect_the_limit_and_never_split_a_group():
    groups = _groups(5)
    buckets = list(split_groups(groups, limit_bytes=1024))
    assert [name for bucket in buckets for name, _ in bucket] == [n for group in groups for n, _ in group]
    for bucket in buckets:
        assert len({name.split(".")[0] for name, _ in bucket}) * 3 == len(bucket)
        assert sum(t.numel() for _, t in bucket) <= 1024 or len(bucket) == 3
    # A group bigger than the limit travels alone rather than being split.
    assert [len(b) for b in split_groups(groups[:2], limit_bytes=100)] == [3, 3]


def test_no_groups_make_no_bucket():
    assert list(split_groups([], limit_bytes=1024)) == []


def test_a_tensor_larger_than_a_bucket_travels_alone_between_its_neighbours():
    small, large = _groups(2, members=1, nbytes=64), [("big", torch.zeros(4096, dtype=torch.uint8))]
    buckets = list(split_groups([small[0], large, small[1]], limit_bytes=1024))
    assert [[name for name, _ in bucket] for bucket in buckets] == [["g0.t0"], ["big"], ["g1.t0"]]


def test_a_fused_group_is_never_split_however_the_limit_falls():
    """q/k/v of each layer as one group: for every limit the members of a group share one bucket."""
    layers = [[(f"layers.{i}.self_attn.{p}_proj.weight", torch.zeros(8, 8)) for p in "qkv"] for i in range(4)]
    for limit in range(1, 4 * 3 * 8 * 8 * 4 + 2, 97):
        buckets = list(split_groups(layers, limit_bytes=limit))
        where = {name: index for index, bucket in enumerate(buckets) for name, _ in bucket}
        for group in layers:
            assert len({where[name] for name, _ in group}) == 1, f"limit {limit} split {group[0][0]}"


def test_sizes_count_aligned_bytes():
    """Each tensor takes its aligned size in the buffer, so the limit is on what is really sent."""
    odd = [[(f"t{i}", torch.zeros(1, dtype=torch.uint8))] for i in range(4)]
    assert [len(b) for b in split_groups(odd, limit_bytes=2 * ALIGNMENT)] == [2, 2]


def test_pack_and_unpack_round_trip_mixed_dtypes_at_aligned_offsets():
    named = [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
        ("c", torch.arange(5, dtype=torch.int64)),
        ("d", torch.arange(12, dtype=torch.float32).reshape(3, 4).t()),  # not contiguous
    ]
    metas, total = layout(named)
    assert all(meta.offset % ALIGNMENT == 0 for meta in metas) and total % ALIGNMENT == 0
    buffer = torch.empty(total, dtype=torch.uint8)
    pack_into(buffer, named, metas)
    for (name, want), (got_name, got) in zip(named, unpack(buffer, [tuple(m) for m in metas]), strict=True):
        assert got_name == name and got.dtype == want.dtype and torch.equal(got, want)
    # vLLM's RPC carries a TensorMeta as a plain sequence (lists once serialized): unpack rebuilds it.
    for (name, want), (_, got) in zip(named, unpack(buffer, json.loads(json.dumps(metas))), strict=True):
        assert torch.equal(got, want), name
    with pytest.raises(TypeError):  # what the RPC makes of a dataclass, a dict, is no layout
        unpack(buffer, [meta._asdict() for meta in metas])
