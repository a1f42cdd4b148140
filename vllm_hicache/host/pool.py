"""The host (L2) KV pool: one buffer of ``num_pages`` pages, each one vLLM
block of every attention layer.

The pool owns the buffer and its layout (see ``host/layout.py``), nothing
else: which page holds what, and which pages are free, is the radix tree's
business (scheduler half). Page ids are buffer indices, identical on every
rank; each rank's pool holds its own KV heads.

Invariants: the buffer is sized and checked against free host memory before
it is allocated, every byte of it is touched once at start-up (first-touch
faults at run time would be slower than the copies they stall), and it is
pinned when a CUDA device exists so that copies are DMA and the Triton
kernels can address it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from vllm_hicache.host.layout import BlockOrder, HostLayout, dtype_size, pool_bytes
from vllm_hicache.host.layout_names import MemLayout
from vllm_hicache.host.memory import MemInfo, check_fits, pin_buffer, unpin_address

logger = logging.getLogger(__name__)

# Zeroing in chunks keeps each pass inside one NUMA-friendly, interruptible
# unit; the size only needs to dwarf per-call overhead.
_TOUCH_CHUNK_BYTES = 1 << 30


def _resolve_order(
    order: BlockOrder | None, planes: int, block_size: int, heads: int, head_size: int
) -> BlockOrder:
    if order is None:
        return BlockOrder.canonical(planes, block_size, heads, head_size)
    if (order.planes, order.block_size, order.heads, order.head_size) != (
        planes, block_size, heads, head_size
    ):
        raise ValueError(
            f"block_order {order} does not describe a block of planes={planes}, "
            f"block_size={block_size}, heads={heads}, head_size={head_size}"
        )
    return order


def _consecutive_runs(pages: Sequence[int]) -> list[tuple[int, int]] | None:
    """(position, length) of each run of ``pages`` whose ids step by +1; None
    when the runs average fewer than two pages.

    Why: a slice copy into a strided (permuted) view of the pool runs
    several times faster than ``index_copy_`` through it, and one copy call
    per run pays off while runs average two pages or more (a layer of 48
    pages of 16 KiB, CPU, a head-major pool: one run 0.05 ms against 0.23,
    runs of two 0.15, single pages 0.23 either way; whole pages: 0.20 ms
    against 1.2). A read's pages mostly come in a few runs."""
    runs: list[tuple[int, int]] = []
    for i, page in enumerate(pages):
        if runs and page == pages[i - 1] + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return None if 2 * len(runs) > len(pages) else runs


def _scatter_rows(target: torch.Tensor, pages: list[int], source: torch.Tensor) -> None:
    """``target[pages[i]] = source[i]`` for every i."""
    runs = _consecutive_runs(pages)
    if runs is None:
        target.index_copy_(0, torch.as_tensor(pages, dtype=torch.long), source)
        return
    for at, length in runs:
        target[pages[at]:pages[at] + length].copy_(source[at:at + length])


class LayerBlocks(Protocol):
    """What a pool is shaped from: one L1 layer's block geometry.

    ``kernels.DeviceKVLayout`` satisfies it; a protocol, so that host/ (below
    kernels/) never imports kernels/.
    """

    @property
    def planes(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def head_size(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def block_order(self) -> BlockOrder: ...


class HostKVPool:
    """A page-addressed host KV buffer in one of the ``MEM_LAYOUTS``.

    ``block_order`` is the L1 tensor's native element order of one block
    (``DeviceKVLayout.block_order``); the native layouts store rows in that
    order. It defaults to the canonical order, which suits tests and
    ``page_first``.
    """

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        planes: int,
        block_size: int,
        heads: int,
        head_size: int,
        dtype: torch.dtype,
        mem_layout: str,
        pin_memory: bool | None = None,
        block_order: BlockOrder | None = None,
        meminfo: MemInfo | None = None,
        reserve_bytes: int | None = None,
    ) -> None:
        order = _resolve_order(block_order, planes, block_size, heads, head_size)
        self.layout = HostLayout(mem_layout, num_pages, num_layers, order)
        self.dtype = dtype
        check_fits(pool_bytes(self.layout, dtype), meminfo, reserve_bytes)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.buffer = self._allocate()
        self.is_pinned = pin_buffer(self.buffer) if pin_memory else False
        # Unregister even if close() is never called: a registered range that
        # torch frees and reuses would stay pinned behind CUDA's back.
        self._unpin = (
            weakref.finalize(self, unpin_address, self.buffer.data_ptr())
            if self.is_pinned
            else None
        )
        logger.debug(
            "host KV pool: %d pages x %d bytes = %.2f GiB, layout %s, pinned %s",
            num_pages,
            self.bytes_per_page,
            self.num_bytes / (1 << 30),
            mem_layout,
            self.is_pinned,
        )

    @classmethod
    def for_layouts(
        cls,
        num_pages: int,
        layouts: Sequence[LayerBlocks],
        mem_layout: str,
        pin_memory: bool | None = None,
        **kwargs,
    ) -> HostKVPool:
        """A pool shaped for these L1 layers (one ``DeviceKVLayout`` per layer)."""
        first = layouts[0]
        return cls(
            num_pages, len(layouts), first.planes, first.block_size, first.heads,
            first.head_size, first.dtype, mem_layout, pin_memory=pin_memory,
            block_order=first.block_order, **kwargs,
        )

    def _allocate(self) -> torch.Tensor:
        start = time.monotonic()
        buffer = torch.empty(self.layout.buffer_shape, dtype=self.dtype)
        flat = buffer.view(-1)
        step = max(1, _TOUCH_CHUNK_BYTES // dtype_size(self.dtype))
        for begin in range(0, flat.numel(), step):
            flat[begin : begin + step].zero_()
        logger.debug("touched host KV pool in %.2f s", time.monotonic() - start)
        return buffer

    # --- geometry ---

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def mem_layout(self) -> str:
        return self.layout.name

    @property
    def bytes_per_page(self) -> int:
        return self.layout.elems_per_page * dtype_size(self.dtype)

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def canonical_page_shape(self) -> tuple[int, ...]:
        """``[num_layers, planes, block_size, heads, head_size]``."""
        o = self.layout.order
        return (self.num_layers, o.planes, o.block_size, o.heads, o.head_size)

    # --- views ---

    def cells(self) -> torch.Tensor:
        """Every element addressed as ``[page, layer, plane, kernel_block,
        token_in_kernel_block, head, elem]`` (a strided view)."""
        return self.layout.cells(self.buffer)

    def page_run(self, page: int) -> torch.Tensor:
        """One page as one contiguous 1-D view (page-major layouts only)."""
        if self.layout.name == MemLayout.LAYER_FIRST:
            raise ValueError(
                "layer_first pages are not contiguous (each layer's block sits "
                "in its own plane); use page_first or page_first_direct"
            )
        return self.buffer[page].view(-1)

    # --- canonical access (tests, L3 storage) ---

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """Copy of the pages, ``[n, num_layers, planes, block_size, heads, head_size]``."""
        index = torch.as_tensor(list(pages), dtype=torch.long)
        # A gather through the strided view is fast; scatters are not (_scatter_rows).
        picked = self.cells().index_select(0, index)
        return picked.reshape(len(index), *self.canonical_page_shape)

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite the pages from ``data`` in the canonical shape of ``read_pages``."""
        pages = list(pages)
        expected = (len(pages), *self.canonical_page_shape)
        if tuple(data.shape) != expected or data.dtype != self.dtype:
            raise ValueError(
                f"write_pages needs {expected} {self.dtype}; got "
                f"{tuple(data.shape)} {data.dtype}"
            )
        cells = self.cells()
        _scatter_rows(cells, pages, data.reshape(len(pages), *cells.shape[1:]))

    def write_layer_payloads(self, layer: int, pages: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite layer ``layer`` of the pages from ``data``: per page, the
        bytes of that layer's run of its L3 payload (``layer_payload_axes``;
        layer-major payloads only), ``[n, bytes]`` uint8."""
        axes = self.layout.layer_payload_axes()
        if axes is None:
            raise ValueError(f"{self.mem_layout} payloads are not layer-major")
        target = self.cells()[:, layer].permute(0, *(1 + axis for axis in axes))
        pages = list(pages)
        _scatter_rows(target, pages, data.view(self.dtype).reshape(len(pages),
                                                                  *target.shape[1:]))

    def close(self) -> None:
        """Unpin the buffer; the pool must not be used afterwards."""
        if self._unpin is not None:
            self._unpin()
            self.is_pinned = False
