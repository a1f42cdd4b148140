"""Copy plans shared by the copy backends: id runs and (host, device) view pairs.

A ``CopyPair`` is two strided views with the same trailing shape, indexed on
dim 0 by page (host) and by block (device). Copying pages P to blocks B is
``pair.device[B] <- pair.host[P]`` for every pair of a plan:

    native layouts   one pair per (layer, segment): host rows [P, E_seg],
                     device segment rows [num_blocks, E_seg]
    page_first       one pair per layer: [P | num_blocks, planes,
                     kernel_blocks, kernel_block_size, heads, head_size]

When the layer tensors are equally spaced views of one allocation (vLLM
0.32 allocates all layers in one buffer) a "stacked" plan adds a layer axis
after dim 0 and covers every layer with one pair per segment, which cuts
the number of copy calls by ``num_layers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from vllm_hicache.host.pool import HostKVPool
from vllm_hicache.kernels.device_layout import DeviceKVLayout


class Run(NamedTuple):
    """``length`` consecutive blocks from ``block`` <-> pages from ``page``."""

    block: int
    page: int
    length: int


class CopyPair(NamedTuple):
    host: torch.Tensor
    device: torch.Tensor


def merge_runs(block_ids: Sequence[int], page_ids: Sequence[int]) -> list[Run]:
    """Merge positional (block, page) pairs where both ids step by +1."""
    runs: list[Run] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if (
            i == len(block_ids)
            or block_ids[i] != block_ids[i - 1] + 1
            or page_ids[i] != page_ids[i - 1] + 1
        ):
            runs.append(Run(block_ids[start], page_ids[start], i - start))
            start = i
    return runs


def check_compatible(
    kv_caches: Sequence[torch.Tensor], layouts: Sequence[DeviceKVLayout], pool: HostKVPool
) -> DeviceKVLayout:
    """The common layout of all layers; ValueError if the pool cannot hold them."""
    if not kv_caches or len(kv_caches) != len(layouts):
        raise ValueError(
            f"need one layout per KV tensor; got {len(kv_caches)} tensors, "
            f"{len(layouts)} layouts"
        )
    first = layouts[0]
    for tensor, layout in zip(kv_caches, layouts):
        if layout != first:
            raise ValueError(f"KV layers differ in layout: {layout} vs {first}")
        layout.check(tensor)
    order = pool.layout.order
    problems = []
    if pool.num_layers != len(kv_caches):
        problems.append(f"{pool.num_layers} pool layers != {len(kv_caches)} KV tensors")
    if pool.dtype != first.dtype:
        problems.append(f"pool dtype {pool.dtype} != KV dtype {first.dtype}")
    if order.dims != first.dims:
        problems.append(f"pool block dims {order.dims} != KV block dims {first.dims}")
    if pool.layout.is_native and order != first.block_order:
        problems.append(f"pool block order {order} != KV native order {first.block_order}")
    if problems:
        raise ValueError("host pool does not match the KV cache: " + "; ".join(problems))
    return first


def layer_pairs(
    pool: HostKVPool, layout: DeviceKVLayout, tensor: torch.Tensor, layer: int
) -> list[CopyPair]:
    """Pairs copying one layer."""
    if not pool.layout.is_native:
        return [CopyPair(pool.cells()[:, layer], layout.cells(tensor))]
    rows = pool.layout.rows(pool.buffer)[:, layer]
    seg = layout.segment_elems
    return [
        CopyPair(rows[:, i * seg : (i + 1) * seg], device)
        for i, device in enumerate(layout.block_segments(tensor))
    ]


def layer_stride(kv_caches: Sequence[torch.Tensor]) -> int | None:
    """Element distance between consecutive layers' tensors if they are
    equally spaced views of one storage, else None."""
    first = kv_caches[0]
    if len(kv_caches) == 1:
        return None
    ptr = first.untyped_storage().data_ptr()
    offsets: list[int] = []
    for tensor in kv_caches:
        if tensor.untyped_storage().data_ptr() != ptr or tensor.dtype != first.dtype:
            return None
        offsets.append(int(tensor.storage_offset()))
    stride = offsets[1] - offsets[0]
    if stride <= 0 or any(b - a != stride for a, b in zip(offsets, offsets[1:])):
        return None
    return stride


def stacked_pairs(
    pool: HostKVPool, layout: DeviceKVLayout, kv_caches: Sequence[torch.Tensor]
) -> list[CopyPair] | None:
    """Pairs copying all layers at once, or None if layers are not stackable."""
    stride = layer_stride(kv_caches)
    if stride is None:
        return None
    first, layers = kv_caches[0], len(kv_caches)
    if not pool.layout.is_native:
        device = first.as_strided(
            (layout.num_blocks, layers, *layout.dims),
            (layout.block_stride, stride, *layout.cell_strides[1:]),
        )
        return [CopyPair(pool.cells(), device)]
    rows = pool.layout.rows(pool.buffer)
    seg = layout.segment_elems
    base = first.storage_offset()
    return [
        CopyPair(
            rows[:, :, i * seg : (i + 1) * seg],
            first.as_strided(
                (layout.num_blocks, layers, seg), (layout.block_stride, stride, 1), base + offset
            ),
        )
        for i, offset in enumerate(layout.segment_offsets)
    ]
