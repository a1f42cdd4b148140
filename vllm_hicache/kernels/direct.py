"""``direct`` I/O backend: torch copies, on CPU and CUDA; the reference the
Triton kernels are tested against.

Per call, the (block, page) pairs are merged into runs where both ids step
by +1, and each run is one ``copy_`` of a slice per plan pair (see
``plan.py``); ``page_first`` pairs are strided on both sides, so the same
``copy_`` transposes. When runs are so short that per-call overhead would
dominate (small blocks, few layers), and both sides live in host memory,
each pair is instead moved with one ``index_select`` + ``index_copy_``:
two passes over the data, but two calls instead of one per run. Nothing
loops over tokens in Python.

On CUDA the copies are queued on the caller's current stream
(``non_blocking``; the pool is pinned), see ``base.py``. There,
torch turns a host <-> device ``copy_`` into one DMA only when both views
are contiguous, so the plan prefers slices that are (per layer rather than
stacked; per block when blocks are strided apart). ``page_first`` rows are
never contiguous on both sides: on CUDA it goes through torch's staging
copies, which is why the config pairs ``page_first`` with ``kernel``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import override

from vllm_hicache.host.pool import HostKVPool
from vllm_hicache.kernels.base import KVTransfer, check_ids
from vllm_hicache.kernels.device_layout import DeviceKVLayout
from vllm_hicache.kernels.io_backends import IOBackend
from vllm_hicache.kernels.plan import (
    CopyPair,
    Run,
    layer_pairs,
    merge_runs,
    stacked_pairs,
)

# Below this many bytes per slice copy, batched indexing beats one copy_
# per run: a copy_ call costs ~4.5 us. Measured on a 2-core x86 VM, bf16,
# scattered ids: 4 KiB runs move 0.9 GB/s as slices vs 4.6-5.2 GB/s indexed;
# 16 KiB runs 2.8 vs 2.1 GB/s; 64 KiB 6.9 vs 1.6 GB/s.
MIN_RUN_BYTES = 8 << 10


class DirectTransfer(KVTransfer):
    io_backend = IOBackend.DIRECT

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layouts: Sequence[DeviceKVLayout],
        pool: HostKVPool,
    ) -> None:
        super().__init__(kv_caches, layouts, pool)
        self._layer_pairs = [
            layer_pairs(pool, self._layout, tensor, layer)
            for layer, tensor in enumerate(kv_caches)
        ]
        stacked = stacked_pairs(pool, self._layout, kv_caches)
        if stacked and self._tracker.is_async and not all(map(memcpy_runs, stacked)):
            # Host <-> device copy_ of a non-contiguous view goes through
            # temporaries and a sync; per-layer slices are often plain DMA.
            stacked = None
        self._all_pairs = stacked or [p for pairs in self._layer_pairs for p in pairs]

    @override
    def store(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        self._copy(self._all_pairs, block_ids, page_ids, to_host=True)

    @override
    def load(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        self._copy(self._all_pairs, block_ids, page_ids, to_host=False)

    @override
    def load_layer(
        self, layer_index: int, block_ids: Sequence[int], page_ids: Sequence[int]
    ) -> None:
        self._copy(self._layer_pairs[layer_index], block_ids, page_ids, to_host=False)
        self._tracker.mark_layer(layer_index)

    @override
    def copy_layers(self, layers: range, block_ids: Sequence[int], page_ids: Sequence[int],
                    to_host: bool) -> None:
        if len(layers) == len(self._layer_pairs):
            pairs = self._all_pairs
        else:
            pairs = [p for layer in layers for p in self._layer_pairs[layer]]
        self._copy(pairs, block_ids, page_ids, to_host)

    def _copy(
        self,
        pairs: list[CopyPair],
        block_ids: Sequence[int],
        page_ids: Sequence[int],
        to_host: bool,
    ) -> None:
        check_ids(block_ids, page_ids, self._layout.num_blocks, self._pool.num_pages)
        runs = merge_runs(block_ids, page_ids)
        if runs:
            with self._tracker.issue():
                self._copy_pairs(pairs, runs, block_ids, page_ids, to_host)

    def _copy_pairs(self, pairs, runs, block_ids, page_ids, to_host) -> None:
        if self._use_index(pairs[0], runs, len(block_ids)):
            blocks = torch.as_tensor(block_ids, dtype=torch.long)
            pages = torch.as_tensor(page_ids, dtype=torch.long)
            for pair in pairs:
                if to_host:
                    pair.host.index_copy_(0, pages, pair.device.index_select(0, blocks))
                else:
                    pair.device.index_copy_(0, blocks, pair.host.index_select(0, pages))
            return
        for pair in pairs:
            for run in self._dma_runs(pair, runs):
                host = pair.host[run.page : run.page + run.length]
                device = pair.device[run.block : run.block + run.length]
                if to_host:
                    host.copy_(device, non_blocking=True)
                else:
                    device.copy_(host, non_blocking=True)

    def _dma_runs(self, pair: CopyPair, runs: list[Run]) -> list[Run]:
        if not self._tracker.is_async or memcpy_runs(pair) or not memcpy_rows(pair):
            return runs
        # Rows contiguous but strided apart (e.g. head-outer L1): one DMA per block.
        return [Run(run.block + i, run.page + i, 1) for run in runs for i in range(run.length)]

    def _use_index(self, pair: CopyPair, runs: list[Run], num_ids: int) -> bool:
        if self._tracker.is_async or len(runs) == 1:
            # Host-to-device indexing would need a staging buffer; runs are
            # DMA-friendly there anyway.
            return False
        run_bytes = pair.host[0].numel() * pair.host.element_size() * num_ids / len(runs)
        return run_bytes < MIN_RUN_BYTES


def memcpy_rows(pair: CopyPair) -> bool:
    """Each block's row is one contiguous range on both sides."""
    return all(t[0].is_contiguous() for t in pair)


def memcpy_runs(pair: CopyPair) -> bool:
    """Any slice ``[i:j]`` is one contiguous range on both sides."""
    return memcpy_rows(pair) and all(
        t.shape[0] == 1 or t.stride(0) == t[0].numel() for t in pair
    )
