"""The L1 <-> L2 copy interface (``factory.py`` builds its implementations).

``KVTransfer`` moves whole blocks between vLLM's KV tensors (L1) and the
host pool (L2). Ids are paired by position: ``block_ids[i]`` <->
``page_ids[i]``. Every layer of a block is copied unless the method says
otherwise. A transfer object is created once per worker, in
``register_kv_caches``.

Ordering: on CUDA each call is queued on the caller's *current* stream and
returns without waiting; calls on one stream run in call order. To overlap
copies with the forward, the caller runs them under
``torch.cuda.stream(transfer_stream)`` after
``transfer_stream.wait_stream(compute_stream)`` (so a store sees the
forward's KV and a load never races kernels still reading a block's old
contents), and makes the compute stream wait (``wait_layer`` or its own
events) before reading loaded blocks. On CPU every call is synchronous.
Calls touching disjoint blocks and pages may come from different threads
(the CPU async loader does): transfers keep no per-call state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from vllm_hicache.host.pool import HostKVPool
from vllm_hicache.kernels.device_layout import DeviceKVLayout
from vllm_hicache.kernels.plan import check_compatible


class KVTransfer(ABC):
    """Copies KV blocks between the L1 tensors and a ``HostKVPool``.

    Constructed with the per-layer L1 tensors in model order, their
    ``DeviceKVLayout`` descriptors (one per layer, all equal but for the
    data) and the pool; it never allocates pages (the radix tree does).
    Source ranges are only read; destination blocks/pages not named in a
    call are never written.
    """

    io_backend: str

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layouts: Sequence[DeviceKVLayout],
        pool: HostKVPool,
    ) -> None:
        self._layout = check_compatible(kv_caches, layouts, pool)
        self._pool = pool
        self._tracker = CopyTracker(kv_caches[0].device)

    @abstractmethod
    def store(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        """Copy L1 blocks (all layers) into host pages (write-through after
        the forward, write-back before vLLM reuses a block). Asynchronous
        on CUDA: the blocks must not be overwritten, nor the pages read,
        before ``synchronize``."""

    @abstractmethod
    def load(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        """Copy host pages into L1 blocks, all layers (loads between steps).
        Asynchronous on CUDA; ``synchronize`` before the blocks are read."""

    @abstractmethod
    def load_layer(
        self, layer_index: int, block_ids: Sequence[int], page_ids: Sequence[int]
    ) -> None:
        """Copy host pages into L1 blocks for one layer (layerwise loading:
        issued from ``start_load_kv``, overlapped with the forward; the
        attention of that layer calls ``wait_layer`` first)."""

    def copy_layers(self, layers: range, block_ids: Sequence[int], page_ids: Sequence[int],
                    to_host: bool) -> None:
        """Copy only ``layers`` (a contiguous range of layer indices) of these
        blocks and pages, in either direction: hybrid models, whose KV cache
        groups each name their own blocks (``datapath.GroupedTransfer``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy a subset of layers")

    def synchronize(self) -> None:
        """Block the calling thread until every issued copy has finished
        (a no-op on CPU, where copies are synchronous)."""
        self._tracker.synchronize()

    def wait_layer(self, layer_index: int) -> None:
        """Make the caller's next work wait for ``load_layer(layer_index)``."""
        self._tracker.wait_layer(layer_index)


class CopyTracker:
    """Completion tracking for copies queued on the caller's CUDA stream.

    Copies are issued on whatever stream is current when a transfer method is
    called: the caller picks it (the worker runs them on its transfer stream,
    after making that stream wait for the compute stream). An event recorded
    after each call serves ``synchronize`` and ``wait_layer``. On CPU copies
    are synchronous and every method is a no-op.
    """

    def __init__(self, device: torch.device) -> None:
        self.is_async = device.type == "cuda"
        # Latest event per stream: waiting for it covers all earlier copies.
        self._last: dict[int, torch.cuda.Event] = {}
        self._layer_events: dict[int, torch.cuda.Event] = {}

    @contextmanager
    def issue(self) -> Iterator[None]:
        """Wrap one transfer call; record its completion event afterwards."""
        yield
        if self.is_async:
            stream = torch.cuda.current_stream()
            self._last[stream.stream_id] = self._record(stream)

    def mark_layer(self, layer_index: int) -> None:
        """Remember when ``load_layer(layer_index)``'s copies are done."""
        if self.is_async:
            self._layer_events[layer_index] = self._record(torch.cuda.current_stream())

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_layer(self, layer_index: int) -> None:
        event = self._layer_events.pop(layer_index, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def synchronize(self) -> None:
        for event in self._last.values():
            event.synchronize()
        self._last.clear()
        self._layer_events.clear()


def check_ids(
    block_ids: Sequence[int], page_ids: Sequence[int], num_blocks: int, num_pages: int
) -> None:
    assert len(block_ids) == len(page_ids), (len(block_ids), len(page_ids))
    if block_ids:
        assert 0 <= min(block_ids) and max(block_ids) < num_blocks, (block_ids, num_blocks)
        assert 0 <= min(page_ids) and max(page_ids) < num_pages, (page_ids, num_pages)
