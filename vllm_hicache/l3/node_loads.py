"""Node-tier hits loaded straight from the shared segment into L1 blocks,
with no private L2 page in between (docs/design.md, "Loading from the node
tier directly").

``NodeDirectLoader.load(hashes, block_ids)`` loads the longest prefix it
can and returns its length; vLLM recomputes the blocks after it. Per call:

1. find the pages of the hashes' objects (``NodeTier.hold_pages``): the
   longest sealed prefix, with each page's slot and generation. On x86-64
   that is one index read and nothing is pinned: a writer unseals a slot
   before changing its bytes (node/segment.py), so the seal checks of steps
   2 and 4 see any refill; elsewhere the pages are pinned, and no member
   evicts or refills them until released. A page evicted since the
   scheduler's lookup, or whose owner died and was reclaimed, is simply not
   found: the prefix ends there.
2. check each slot before copying: its seal names the key at the
   index's generation (else torn, foreign or refilled). Checksum objects
   are not hashed again: their publisher checked them (storage/node_direct.py
   gives the rule). With a MAC, the object in place opens (header, key,
   length, MAC) read-only, once per generation of the slot in this process:
   a sealed slot's bytes change only with a new generation, which the seal
   check catches. A slot that fails is dropped from the tier and ends the
   prefix.
3. copy the verified prefix with the ordinary copy engine over a
   ``SegmentKVPool`` (host/segment_pool.py), and wait for it (on CUDA too:
   the seals are checked and the pages released only after the DMA ended).
4. check every seal again: a slot whose seal changed during the copy (a
   refill of an unpinned slot) ends the prefix at it, so its block is
   recomputed.
5. release the pages (their pins, if any), counting hits and misses for this
   member and marking the pages read as used (for the eviction order); a
   load in the step releases them on the queue's thread, after the copy it
   waited for.

Where the segment is not registered with CUDA (CPU engines), the loader
maps it into this process on a background thread at start (map_warmer.py),
so that a first read of a slot pays no page faults on the forward's thread.

Invariant: a block counted as loaded received exactly its key's verified
bytes, or the call says fewer blocks were loaded; any error (tier, copy)
is fewer blocks, never an exception into the forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hicache.host.segment_pool import SegmentKVPool
from vllm_hicache.kernels import DeviceKVLayout, make_transfer
from vllm_hicache.kernels.io_backends import IOBackend
from vllm_hicache.l3.map_warmer import MappingWarmer
from vllm_hicache.node import Found, NodeTier, NodeTierError
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.node_chain import node_key
from vllm_hicache.storage.node_direct import ObjectCheck, direct_read_blocker, object_check
from vllm_hicache.storage.pages import PageStore

logger = logging.getLogger(__name__)


@dataclass
class OpenLoad:
    """A direct load between ``NodeDirectLoader.begin`` and ``finish``: its
    held pages, the blocks they go to, how many were asked for, how many
    leading pages passed their checks (what is copied), and whether a copy
    of it failed."""

    pages: list[Found]
    block_ids: tuple[int, ...]
    asked: int
    usable: int
    failed: bool = False


class NodeDirectLoader:
    """Loads node-tier pages into L1 blocks for one worker.

    ``transfer``: a copy engine (kernels.KVTransfer) whose pool is the
    tier's ``SegmentKVPool`` (page id = slot); ``object_keys``: block hashes
    -> object keys (``PageStore.keys``); ``check``: the read-only object
    check of a slot's first read (storage/node_direct.py; None: seals
    only); ``pool``: that SegmentKVPool, unpinned by ``close``.
    """

    def __init__(self, tier: NodeTier, transfer, object_keys,
                 check: ObjectCheck | None,
                 pool: SegmentKVPool | None = None, premap: bool = False) -> None:
        self.tier = tier
        self.transfer = transfer
        self.pool = pool
        self._object_keys = object_keys
        self._check = check
        g = tier.geometry
        self._slot_stride_bytes = g.slot_stride
        self._data_offset_bytes = g.data_offset
        self._payload_bytes = g.page_bytes - HEADER_BYTES
        self._segment = np.frombuffer(tier.mapping(), np.uint8)
        # Slots map into this process ahead of their first read (map_warmer.py).
        self.premap = (MappingWarmer(self._segment.ctypes.data, self._segment.nbytes)
                       if premap else None)
        # slot -> generation whose bytes this process verified.
        self._verified: dict[int, int] = {}
        self.counts = Counters("pages", "bytes", "misses", "refused", "copy_errors")

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int],
             defer: Callable[..., object] | None = None) -> int:
        """Load the pages of ``hashes`` into ``block_ids`` (by position);
        returns how many leading blocks now hold their page. ``defer``
        (e.g. an executor's ``submit``) runs the release of the pages, an
        index transaction nobody waits for, off the caller's thread."""
        op = self.begin(hashes, block_ids)
        if op is None:
            return 0
        self.copy(op)
        return self.finish(op, defer)

    def begin(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> OpenLoad | None:
        """Find (or pin) and check the pages of ``hashes`` (steps 1 and 2);
        None when none was found. ``copy`` then ``finish`` it."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"node load: {len(hashes)} hashes but {len(block_ids)} blocks")
        if not hashes:
            return None
        keys = self._object_keys(hashes)
        try:
            pages = self.tier.hold_pages([node_key(k) for k in keys])
        except NodeTierError as e:
            logger.warning("HiCache node tier: finding the pages of a direct load failed (%s): "
                           "a miss", e)
            self.counts.bump("misses", len(hashes))
            return None
        usable = 0
        try:
            # Remembered slots were checked as they were found; not twice.
            sealed = pages.checked + self.tier.seals_held(pages[pages.checked:])
            for page, key in zip(pages[:sealed], keys):
                if not self._verifies(page, key):
                    break
                usable += 1
            if usable == sealed < len(pages):
                self._refuse(pages[sealed], "failed its seal")
        except BaseException:
            self._finish_counts(OpenLoad(pages, tuple(block_ids), len(hashes), 0), 0, None)
            raise
        return OpenLoad(pages, tuple(block_ids), len(hashes), usable)

    def copy(self, op: OpenLoad, layer: int | None = None) -> None:
        """Copy the checked prefix of ``op``: one layer of it, or every layer
        (None). A copy that raises fails the whole load, never the caller."""
        if op.failed or not op.usable:
            return
        block_ids = list(op.block_ids[:op.usable])
        slots = [p.slot for p in op.pages[:op.usable]]
        try:
            if layer is None:
                self.transfer.load(block_ids, slots)
            else:
                self.transfer.load_layer(layer, block_ids, slots)
        except Exception:  # a failed copy is a recompute, never a crash
            logger.exception("HiCache: direct load of %d node-tier pages failed", op.usable)
            self._copy_failed(op)

    def finish(self, op: OpenLoad, defer: Callable[..., object] | None = None) -> int:
        """After every copy of ``op``: wait for them, check the seals again
        and release the pages (steps 3 to 5); how many leading blocks hold
        their page."""
        loaded = 0
        try:
            if not op.failed and op.usable:
                try:
                    self.transfer.synchronize()
                except Exception:  # a failed copy is a recompute, never a crash
                    logger.exception("HiCache: direct load of %d node-tier pages failed",
                                     op.usable)
                    self._copy_failed(op)
            if not op.failed:
                loaded = self._seals_held(op)
        finally:
            self._finish_counts(op, loaded, defer)
        return loaded

    def _copy_failed(self, op: OpenLoad) -> None:
        self.counts.bump("copy_errors", op.usable)
        op.failed = True

    def _seals_held(self, op: OpenLoad) -> int:
        """The leading copied pages whose seal did not change meanwhile (a
        change, a refill of an unpinned slot, ends the prefix there)."""
        held = self.tier.seals_held(op.pages[:op.usable])
        if held < op.usable:
            self._refuse(op.pages[held], "changed its seal while being copied")
        return held

    def _refuse(self, page: Found, why: str) -> None:
        self._verified.pop(page.slot, None)
        self.tier.drop_page(page, why)
        self.counts.bump("refused")

    def _finish_counts(self, op: OpenLoad, loaded: int,
                       defer: Callable[..., object] | None) -> None:
        self._count(loaded, op.asked)
        if defer is None:
            self._release(op.pages, loaded, op.asked)
        else:
            defer(self._release, op.pages, loaded, op.asked)

    def _verifies(self, page: Found, key: str) -> bool:
        """The object in a slot whose seal names this page opens (checked
        once per generation of the slot; always, without a check)."""
        if self._check is None or self._verified.get(page.slot) == page.gen:
            return True
        start = self._data_offset_bytes + page.slot * self._slot_stride_bytes
        header = self._segment[start:start + HEADER_BYTES]
        payload = self._segment[start + HEADER_BYTES:start + HEADER_BYTES + self._payload_bytes]
        if not self._check(key, header, payload):
            self._refuse(page, "did not verify (corrupt or foreign object)")
            return False
        self._verified[page.slot] = page.gen
        return True

    def _count(self, loaded: int, asked: int) -> None:
        self.counts.bump("pages", loaded)
        self.counts.bump("bytes", loaded * self._payload_bytes)
        self.counts.bump("misses", asked - loaded)

    def _release(self, pages: list[Found], loaded: int, asked: int) -> None:
        try:
            self.tier.release_pages(pages, hits=loaded, misses=asked - loaded)
        except NodeTierError as e:
            # Pins (where held) are this member's: its leave, or its death, drops them.
            logger.warning("HiCache node tier: releasing %d pages failed (%s)", len(pages), e)

    def close(self) -> None:
        """Unregister the segment and drop the views of the mapping (before
        the tier leaves)."""
        if self.premap is not None:
            self.premap.stop()
        if self.pool is not None:
            self.pool.close()
        self._segment = np.empty(0, np.uint8)
        self._verified.clear()


def build_direct_loader(tier: NodeTier, store: PageStore, kv_tensors: Sequence[torch.Tensor],
                        layouts: Sequence[DeviceKVLayout], io_backend: str) -> NodeDirectLoader:
    """A loader from ``tier`` into these L1 tensors, for the objects
    ``store`` writes (its pool gives the page layout). ValueError naming
    the reason when the tier's slots cannot be read in place. On CUDA the
    segment is registered as pinned memory; the ``kernel`` backend needs
    that, so an unregistered segment is copied with ``direct``."""
    blocker = direct_read_blocker(store, tier.geometry.page_bytes)
    if blocker is not None:
        raise ValueError(f"node tier pages cannot be loaded into L1 directly: {blocker}")
    g = tier.geometry
    on_cuda = kv_tensors[0].device.type == "cuda"
    pool = SegmentKVPool(tier.mapping(), num_slots=g.num_slots, slot_stride_bytes=g.slot_stride,
                         first_payload_offset_bytes=g.data_offset + HEADER_BYTES,
                         like=store.pool, pin_memory=on_cuda)
    if io_backend == IOBackend.KERNEL and not pool.is_pinned:
        io_backend = IOBackend.DIRECT
    transfer = make_transfer(io_backend, kv_tensors, layouts, pool)
    # A registered segment is mapped already; an unregistered one is premapped.
    return NodeDirectLoader(tier, transfer, store.keys, object_check(store), pool,
                            premap=not pool.is_pinned)
