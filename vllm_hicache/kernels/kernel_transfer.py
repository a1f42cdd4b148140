"""``kernel`` I/O backend: the Triton kernels of ``triton_copy.py`` driven
with address tables built per call.

Native layouts: one item per (layer, segment, pair), ``segment_elems``
contiguous elements on both sides; the item addresses are computed on the
CPU with int64 broadcasting (O(layers x segments x pairs) integers, never
per token) and shipped to the device in one copy. ``page_first``: the
kernel computes addresses from strides; only the ids are shipped.

Copy unit: the widest of 8/4/2/1 bytes dividing every base address, stride
and row length involved, so bf16 KV with 16-byte aligned blocks moves as
int64 words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from typing_extensions import override

from vllm_hicache.host.layout import as_dims5
from vllm_hicache.host.pool import HostKVPool
from vllm_hicache.kernels.base import KVTransfer, check_ids
from vllm_hicache.kernels.device_layout import DeviceKVLayout
from vllm_hicache.kernels.io_backends import IOBackend


def _unit_bytes(*values: int) -> int:
    common = 0
    for value in values:
        common = math.gcd(common, value)
    return next(unit for unit in (8, 4, 2, 1) if common % unit == 0)


class KernelTransfer(KVTransfer):
    io_backend = IOBackend.KERNEL

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layouts: Sequence[DeviceKVLayout],
        pool: HostKVPool,
    ) -> None:
        from vllm_hicache.kernels import triton_copy

        self._ops = triton_copy
        super().__init__(kv_caches, layouts, pool)
        layout = self._layout
        self._device = kv_caches[0].device
        if self._device.type == "cuda" and not pool.is_pinned:
            raise ValueError("the kernel I/O backend needs a pinned host pool (UVA)")
        if self._device.type == "cuda" and triton_copy.is_interpreted():
            # The interpreter would dereference device addresses on the CPU.
            raise ValueError("TRITON_INTERPRET=1 is set; the kernel backend cannot run on CUDA")
        if self._device.type != "cuda" and not triton_copy.is_interpreted():
            raise ValueError(
                f"the kernel I/O backend needs CUDA tensors (got {self._device}); "
                "CPU tensors work only under TRITON_INTERPRET=1 (tests)"
            )
        self._esize = esize = kv_caches[0].element_size()
        self._layer_bases = [t.data_ptr() for t in kv_caches]
        self._host_base = pool.buffer.data_ptr()
        if pool.layout.is_native:
            rows = pool.layout.rows(pool.buffer)
            self._host_page_bytes = rows.stride(0) * esize
            self._host_layer_bytes = rows.stride(1) * esize
            self._seg_bases = torch.tensor(
                [[b + off * esize for off in layout.segment_offsets] for b in self._layer_bases],
                dtype=torch.int64,
            )
            self._unit = _unit_bytes(
                *self._seg_bases.flatten().tolist(), self._host_base, self._host_page_bytes,
                self._host_layer_bytes, layout.block_stride * esize, layout.segment_elems * esize,
            )
        else:
            self._init_page_first(layout, pool)

    def _init_page_first(self, layout: DeviceKVLayout, pool: HostKVPool) -> None:
        esize = self._esize
        if layout.cell_strides[5] != 1:
            raise ValueError(f"page_first kernel needs head_size-contiguous rows; got {layout}")
        # Host buffer [pages, planes, block_size, layers, heads, head_size].
        page, plane, token, layer, head, _ = pool.buffer.stride()
        host = (page, layer, plane, token, head)
        sizes = (layout.num_blocks, *layout.dims[:4])
        device = tuple(s if n > 1 else 0 for s, n in zip(layout.cell_strides[:5], sizes))
        self._unit = unit = _unit_bytes(
            self._host_base, *self._layer_bases, layout.head_size * esize,
            *(s * esize for s in host + device),
        )
        self._host_strides = as_dims5(s * esize // unit for s in host)
        self._device_strides = as_dims5(s * esize // unit for s in device)
        self._bases = torch.tensor(
            [self._host_base, *self._layer_bases], dtype=torch.int64, device=self._device
        )

    @override
    def store(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        self._copy(range(len(self._layer_bases)), block_ids, page_ids, to_host=True)

    @override
    def load(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        self._copy(range(len(self._layer_bases)), block_ids, page_ids, to_host=False)

    @override
    def load_layer(
        self, layer_index: int, block_ids: Sequence[int], page_ids: Sequence[int]
    ) -> None:
        self._copy(range(layer_index, layer_index + 1), block_ids, page_ids, to_host=False)
        self._tracker.mark_layer(layer_index)

    @override
    def copy_layers(self, layers: range, block_ids: Sequence[int], page_ids: Sequence[int],
                    to_host: bool) -> None:
        self._copy(layers, block_ids, page_ids, to_host)

    def _copy(
        self, layers: range, block_ids: Sequence[int], page_ids: Sequence[int], to_host: bool
    ) -> None:
        check_ids(block_ids, page_ids, self._layout.num_blocks, self._pool.num_pages)
        if not block_ids:
            return
        ids = torch.tensor([list(block_ids), list(page_ids)], dtype=torch.int64)
        with self._tracker.issue():
            if self._pool.layout.is_native:
                self._copy_native(layers, ids, to_host)
            else:
                ids = self._to_device(ids)
                self._ops.copy_page_first(
                    self._bases, ids[0], ids[1], layers,
                    (self._layout.planes, self._layout.block_size, self._layout.dims[2],
                     self._layout.heads, self._layout.head_size * self._esize // self._unit),
                    self._device_strides, self._host_strides, self._unit, to_host,
                )

    def _copy_native(self, layers: range, ids: torch.Tensor, to_host: bool) -> None:
        layout, esize = self._layout, self._esize
        blocks, pages = ids[0], ids[1]
        seg_bases = self._seg_bases[layers.start : layers.stop]
        device = seg_bases[:, :, None] + blocks * (layout.block_stride * esize)
        layer_offsets = torch.arange(layers.start, layers.stop) * self._host_layer_bytes
        seg_offsets = torch.arange(layout.num_segments) * (layout.segment_elems * esize)
        host = (
            self._host_base
            + layer_offsets[:, None, None]
            + seg_offsets[None, :, None]
            + pages * self._host_page_bytes
        )
        src, dst = (device, host) if to_host else (host, device)
        table = self._to_device(torch.stack([src.flatten(), dst.flatten()]))
        self._ops.copy_items(table[0], table[1], layout.segment_elems * esize, self._unit)

    def _to_device(self, table: torch.Tensor) -> torch.Tensor:
        """Ship an address table without blocking the issuing thread: a
        plain ``.to(device)`` waits for the current stream to drain, which
        would make queueing layer N+1's loads wait for layer N's copies.
        The pinned staging buffer is recycled by torch only after the copy."""
        if self._device.type != "cuda":
            return table
        return table.pin_memory().to(self._device, non_blocking=True)
