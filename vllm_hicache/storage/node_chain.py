"""The node tier (vllm_hicache/node/) as the nearest L3 store: a
``StorageBackend`` that puts the machine's shared host-memory tier in front
of the configured remote backend, if any.

This first integration stages through the private L2: the L3 machinery
(planner, prefetch, backups, sealing) moves objects between the host pool and
this backend, and this backend between the objects and the node tier's
slots. (Loading from the shared segment into L1 directly is a later step.)

Rules, per object key:
- A slot holds one whole object (header + payload), sealed under a 32-byte
  digest of the object key. Object keys carry the key namespace (model,
  weights, dtype, layout, parallel shape, storage-secret tag) and the block
  hash (which carries any ``cache_salt``), so digests of different
  identities never meet. The tier's directory is named after the rank-0
  namespace as well, so instances of different models or shapes do not even
  share a segment (and its page size).
- ``exists_prefix``: the node tier's prefix, continued in the remote store.
- ``get``: from the node tier; what it misses, from the remote store, and
  each object read there is promoted into the node tier (the next instance
  of the machine finds it there), once ``promotion_check`` (set by the
  worker that owns the page store, storage/node_direct.py) passed it: a
  corrupt or forged remote object is returned to the caller, whose own
  check refuses it, and never published to the machine.
- ``put``: into the node tier, then to the remote store only the objects
  this instance sealed first, or could not place in the node tier: a page
  the machine already has was sent (or is being sent) by the instance that
  sealed it, so each page is written to the remote store once per machine.
  (If that write failed, the page reaches the remote store only after it
  left the node tier and is stored again: a later remote miss, never wrong
  bytes.)
- An object counts as stored when it is in the node tier, and, with a remote
  store, when the remote write it needed succeeded.

Keys: storage/node_keys.py (an evicted page can be named back as a block).
What this process changed in the tier (keys it sealed, keys its
reservations evicted; the last change per key) goes out with the remote
store's removals from ``take_removed_keys``, for the scheduler half's
``NODE`` KV events (l3/node_events.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from vllm_hicache.node import NodeTier, NodeTierError
from vllm_hicache.storage.base import Buffers, StorageBackend, StorageContext
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.log_throttle import LogThrottle
from vllm_hicache.storage.node_keys import EVICTED, PROMOTED, SEALED, node_key, tier_changes

logger = logging.getLogger(__name__)


# Tier changes kept for take_removed_keys, at most (the scheduler half takes
# them every step; beyond, the oldest are dropped: a missed KV event).
MAX_TIER_CHANGES = 1 << 16

__all__ = ["NodeChainBackend", "node_key", "node_tier_status"]


class NodeChainBackend(StorageBackend):
    """The node tier, then ``remote`` (None: the node tier alone). Owns
    both: ``close`` leaves the tier and closes ``remote``."""

    name: ClassVar[str] = "node"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext, *,
                 tier: NodeTier | None = None, remote: StorageBackend | None = None) -> None:
        if options:
            raise ValueError(f"the node tier backend takes no options, got {sorted(options)}")
        if tier is None:
            raise ValueError("the node tier backend needs a joined NodeTier")
        self.tier = tier
        self.remote = remote
        self._object_bytes = ctx.object_bytes
        self._counts = Counters("hits", "remote_hits", "promotions", "promotions_refused",
                                 "inserts", "evictions", "remote_puts_skipped")
        # (object key, its buffers) -> whether a remote object may be
        # promoted; None promotes what the remote store returned.
        self.promotion_check: Callable[[str, Buffers], bool] | None = None
        self._scratch = threading.local()
        self._refused_log = LogThrottle()
        # node key -> its last change here (node_keys.py), oldest first.
        self._changes: dict[bytes, str] = {}
        self._changes_lock = threading.Lock()

    # --- lookups and reads -------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        return self.exists_prefix_split(keys)[1]

    def exists_prefix_split(self, keys: Sequence[str]) -> tuple[int, int]:
        """(how many leading ``keys`` the node tier has, how many the chain
        has: the node tier's prefix continued in the remote store)."""
        keys = list(keys)
        node = found = self._node_prefix(keys)
        if self.remote is not None and found < len(keys):
            found += self.remote.exists_prefix(keys[found:])
        return node, found

    def _node_prefix(self, keys: list[str]) -> int:
        try:
            return self.tier.lookup([node_key(k) for k in keys])
        except NodeTierError as e:
            logger.warning("HiCache node tier lookup failed (%s): a miss", e)
            return 0

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        keys = list(keys)
        ok = [self._read_node(k, t) for k, t in zip(keys, targets)]
        self._counts.bump("hits", sum(ok))
        missed = [i for i, hit in enumerate(ok) if not hit]
        if self.remote is None or not missed:
            return ok
        remote_ok = self.remote.get([keys[i] for i in missed], [targets[i] for i in missed])
        fetched = [i for i, hit in zip(missed, remote_ok) if hit]
        self._counts.bump("remote_hits", len(fetched))
        for i in fetched:
            ok[i] = True
        promote = self._promotable(keys, targets, fetched)
        promoted = self._put_node([keys[i] for i in promote], [targets[i] for i in promote],
                                  PROMOTED)
        self._counts.bump("promotions", sum(1 for p in promoted if p))
        return ok

    def _promotable(self, keys: list[str], targets: Sequence[Buffers],
                    fetched: list[int]) -> list[int]:
        """The remote objects (indices) that pass ``promotion_check``."""
        check = self.promotion_check
        if check is None:
            return fetched
        good = [i for i in fetched if check(keys[i], targets[i])]
        refused = len(fetched) - len(good)
        if refused:
            self._counts.bump("promotions_refused", refused)
            if self._refused_log.ready():
                logger.warning("HiCache node tier: %d objects read from the remote store did "
                               "not verify (corrupt, or written with another secret): not "
                               "promoted (counted in node_tier_promotions_refused)", refused)
        return good

    def _read_node(self, key: str, target: Buffers) -> bool:
        if sum(b.nbytes for b in target) != self._object_bytes:
            return False
        page = target[0] if len(target) == 1 else self._scratch_page()
        try:
            if not self.tier.read(node_key(key), page):
                return False
        except NodeTierError as e:
            logger.warning("HiCache node tier read failed (%s): a miss", e)
            return False
        if page is not target[0]:
            _scatter(page, target)
        return True

    def _scratch_page(self) -> np.ndarray:
        page = getattr(self._scratch, "page", None)
        if page is None:
            page = self._scratch.page = np.empty(self._object_bytes, np.uint8)
        return page

    # --- writes ------------------------------------------------------------------

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        keys, sources = list(keys), list(sources)
        sealed = self._put_node(keys, sources, SEALED)
        self._counts.bump("inserts", sum(1 for s in sealed if s))
        if self.remote is None:
            return [s is not None for s in sealed]
        # Remote writes: what this instance sealed first or could not place.
        send = [i for i, s in enumerate(sealed) if s is not False]
        self._counts.bump("remote_puts_skipped", len(keys) - len(send))
        ok = [s is False for s in sealed]
        if send:
            for i, stored in zip(send, self.remote.put([keys[i] for i in send],
                                                       [sources[i] for i in send])):
                ok[i] = stored
        return ok

    def _put_node(self, keys: list[str], sources: list[Buffers],
                  change: str) -> list[bool | None]:
        """Per key: True sealed by this call (noted as ``change``), False
        present already (sealed by another member), None not placed (no
        slot, wrong size, error)."""
        out: list[bool | None] = [None] * len(keys)
        todo = [i for i, src in enumerate(sources)
                if sum(b.nbytes for b in src) == self._object_bytes]
        if not todo:
            return out
        try:
            got = self.tier.reserve(len(todo))
        except NodeTierError as e:
            logger.warning("HiCache node tier: no slots for %d objects (%s)", len(todo), e)
            return out
        self._counts.bump("evictions", len(got.evicted_keys))
        self._note_changes(got.evicted_keys, EVICTED)
        for i, slot in zip(todo, got.slots):
            try:
                _gather(sources[i], self.tier.view(slot))
                out[i] = self.tier.seal(slot, node_key(keys[i]), self._object_bytes)
            except NodeTierError as e:
                logger.warning("HiCache node tier: storing an object failed (%s)", e)
                self._abort(slot)
        self._note_changes([node_key(keys[i]) for i, s in enumerate(out) if s], change)
        return out

    def _note_changes(self, keys: Sequence[bytes], change: str) -> None:
        if not keys:
            return
        with self._changes_lock:
            changes = self._changes
            for k in keys:
                changes.pop(k, None)  # the last change is the one that holds
                changes[k] = change
            while len(changes) > MAX_TIER_CHANGES:
                del changes[next(iter(changes))]

    def take_removed_keys(self) -> list[str]:
        """The remote store's removals, and this process's tier changes
        (storage/node_keys.py)."""
        with self._changes_lock:
            changes, self._changes = self._changes, {}
        out = self.remote.take_removed_keys() if self.remote is not None else []
        return out + tier_changes(changes)

    def _abort(self, slot) -> None:
        try:
            self.tier.abort(slot)
        except NodeTierError:
            pass  # the sweep of a later reservation reclaims it

    # --- admin, stats, close -----------------------------------------------------

    def clear(self) -> None:
        dropped = self.tier.clear()
        logger.info("HiCache node tier %r: cleared %d pages", self.tier.name, dropped)
        if self.remote is not None:
            self.remote.clear()

    def counts(self) -> dict[str, float]:
        """This process's counts (hits, remote_hits, promotions,
        promotions_refused, inserts, evictions, remote_puts_skipped) since
        it was built; no index query."""
        return self._counts.snapshot()

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.remote is not None:
            out.update(self.remote.stats())
        out.update({f"node_tier_{k}": float(v) for k, v in self._counts.snapshot().items()})
        try:
            tier = self.tier.stats()
        except NodeTierError:
            return out
        out.update(node_tier_capacity_bytes=float(tier.capacity_bytes),
                   node_tier_occupancy_bytes=float(tier.occupancy_bytes),
                   node_tier_members=float(len(tier.members)))
        return out

    def close(self) -> None:
        try:
            self.tier.leave()
        finally:
            if self.remote is not None:
                self.remote.close()


def _gather(src: Buffers, dst: memoryview) -> None:
    at = 0
    for b in src:
        n = b.nbytes
        dst[at:at + n] = memoryview(b).cast("B")
        at += n


def _scatter(page: np.ndarray, target: Buffers) -> None:
    at = 0
    for b in target:
        n = b.nbytes
        b[...] = page[at:at + n].reshape(b.shape)
        at += n


def node_tier_status(backend: StorageBackend | None,
                     instance: dict[str, int] | None = None) -> dict[str, Any] | None:
    """The node tier as the admin API's GET shows it (None: no node tier):
    its size and slots, per member (each process of each instance that
    joined) its hits, misses, inserts and evictions (page copies), and
    ``instance``: this instance's counts (l3/node_events.py)."""
    if not isinstance(backend, NodeChainBackend):
        return None
    stats = backend.tier.stats()
    return {
        "name": stats.name, "directory": backend.tier.directory,
        "capacity_bytes": stats.capacity_bytes, "used_bytes": stats.occupancy_bytes,
        "page_bytes": stats.page_bytes, "slots": stats.num_slots,
        "free_slots": stats.free_slots, "pinned_slots": stats.pinned_slots,
        "this_member": backend.tier.member_id,
        "instance": instance,
        "members": {m: {"hits": s.hits, "misses": s.misses, "inserts": s.inserts,
                        "evictions": s.evictions} for m, s in stats.members.items()},
    }
