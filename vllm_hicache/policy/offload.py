"""Offload backpressure: L2 -> L3 backups must never tax serving.

Every page stored to L2 is backed up to L3 on the workers' L3 threads, and
stays pinned in L2 until every rank acknowledged its write. When L3 writes
fall behind (a slow or congested store), pinned pages pile up: L2 has less
room, stores get skipped for lack of unpinned pages, evictions take pages
that were about to be hit, and the queue of writes grows without bound.

So backups in flight are bounded (``backup_inflight_cap``): a step's stores
are backed up at once while fewer pages than the bound are unacknowledged
(their pages are pinned by their store anyway, and a step is never split),
and are otherwise *deferred*, not pinned: they wait in a bounded
``BackupBacklog`` while their pages stay ordinary (evictable) L2 pages. The
room left under the bound flushes the backlog, most valuable first, so L3
catches up when the engine idles or the store drains. A deferred block whose
page left L2 meanwhile can no longer be backed up (counted); a full backlog
cuts its least valuable entry (counted). Nothing waits on a deferred block:
it is only a later L3 miss.

Value of an entry (one stored run of one chain): how many requests used its
blocks since it was deferred, then how shallow it starts (a prefix is the
way into everything below it: L3 lookups are by prefix, so an extension
without its prefix is worth little), then how recent it is. Within an
entry, blocks leave in chain order: a partial flush writes the prefix, a
partial drop cuts the tail.

Pure module: no torch, no vllm.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Backup pages in flight, at most: a quarter of the L3 prefetch cap (which
# is 80% of what L2 holds beyond L1), within these bounds.
MIN_INFLIGHT_BACKUP_PAGES = 64
MAX_INFLIGHT_BACKUP_PAGES = 4096
# Backlog: at most this many entries (and blocks: the size of L2).
MAX_BACKLOG_ENTRIES = 4096


def backup_inflight_cap(prefetch_cap_pages: int) -> int:
    """Backup pages in flight, at most, for an L3 prefetch cap of
    ``prefetch_cap_pages`` (l3_setup.build_planner)."""
    return max(MIN_INFLIGHT_BACKUP_PAGES, min(prefetch_cap_pages // 4, MAX_INFLIGHT_BACKUP_PAGES))


@dataclass(slots=True)
class Deferred:
    """Blocks ``blocks`` (ascending) of the chain ``chain`` (hashes of blocks
    0 .. the last of them), waiting for their backup."""

    chain: tuple[bytes, ...]
    blocks: tuple[int, ...]
    hits: int = 0
    seq: int = 0
    version: int = 0

    def value(self) -> tuple[int, int, int]:
        return (self.hits, -self.blocks[0], self.seq)


# A heap item: (a Deferred.value(), negated for the max-heap; entry id; the
# entry's version when pushed).
_HeapItem = tuple[tuple[int, int, int], int, int]


class BackupBacklog:
    """Bounded queue of deferred backups, most valuable out first, least
    valuable dropped first (see module doc)."""

    def __init__(self, max_blocks: int, max_entries: int = MAX_BACKLOG_ENTRIES) -> None:
        assert max_blocks > 0 and max_entries > 0, (max_blocks, max_entries)
        self.max_blocks = max_blocks
        self.max_entries = max_entries
        self._entries: dict[int, Deferred] = {}
        self._by_hash: dict[bytes, int] = {}   # a deferred block's hash -> its entry
        self._seq = itertools.count()
        # Lazy heaps of (key, entry id, version); stale items are skipped.
        self._best: list[_HeapItem] = []    # max-heap by value (negated keys)
        self._worst: list[_HeapItem] = []   # min-heap by value
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def defer(self, chain: Sequence[bytes], blocks: Sequence[int]) -> int:
        """Queue blocks ``blocks`` of ``chain``; returns how many blocks
        (these or others) the bound made it drop."""
        blocks = tuple(b for b in blocks if chain[b] not in self._by_hash)
        if not blocks:
            return 0
        seq = next(self._seq)
        entry = Deferred(tuple(chain[: blocks[-1] + 1]), blocks, seq=seq)
        self._entries[seq] = entry
        for b in blocks:
            self._by_hash[entry.chain[b]] = seq
        self.num_blocks += len(blocks)
        self._push(seq, entry)
        dropped = 0
        while len(self._entries) > self.max_entries:
            dropped += self._drop_worst(self.num_blocks)
        while self.num_blocks > self.max_blocks:
            dropped += self._drop_worst(self.num_blocks - self.max_blocks)
        return dropped

    def record_use(self, hashes: Iterable[bytes]) -> None:
        """A request used (hit or shared) these blocks: their entries gain value."""
        if not self._by_hash:
            return
        seen: set[int] = set()
        for h in hashes:
            seq = self._by_hash.get(h)
            if seq is not None and seq not in seen:
                seen.add(seq)
                entry = self._entries[seq]
                entry.hits += 1
                entry.version += 1
                self._push(seq, entry)

    def entries(self) -> list[Deferred]:
        """The deferred entries, in no particular order; nothing leaves."""
        return list(self._entries.values())

    def take(self, budget: int) -> list[Deferred]:
        """Up to ``budget`` blocks, most valuable entries first; an entry
        larger than what is left gives its leading blocks."""
        out: list[Deferred] = []
        while budget > 0 and self._entries:
            seq = self._pop(self._best)
            entry = self._entries[seq]
            if len(entry.blocks) <= budget:
                self._remove(seq)
                out.append(entry)
                budget -= len(entry.blocks)
                continue
            head, rest = entry.blocks[:budget], entry.blocks[budget:]
            for b in head:
                del self._by_hash[entry.chain[b]]
            self.num_blocks -= len(head)
            out.append(Deferred(entry.chain[: head[-1] + 1], head, entry.hits, entry.seq))
            entry.blocks = rest
            entry.version += 1
            self._push(seq, entry)
            budget = 0
        self._compact()
        return out

    def clear(self) -> int:
        """Forget everything; returns the blocks dropped."""
        dropped = self.num_blocks
        self._entries.clear()
        self._by_hash.clear()
        self._best.clear()
        self._worst.clear()
        self.num_blocks = 0
        return dropped

    # --- internals -----------------------------------------------------------

    def _push(self, seq: int, entry: Deferred) -> None:
        v = entry.value()
        heapq.heappush(self._best, ((-v[0], -v[1], -v[2]), seq, entry.version))
        heapq.heappush(self._worst, (v, seq, entry.version))

    def _pop(self, heap: list[_HeapItem]) -> int:
        """The id of the top live entry of ``heap`` (not removed from the backlog)."""
        while True:
            _, seq, version = heapq.heappop(heap)
            entry = self._entries.get(seq)
            if entry is not None and entry.version == version:
                return seq

    def _drop_worst(self, excess: int) -> int:
        """Drop the least valuable entry's last ``excess`` blocks (all of
        them if it has no more); returns the blocks dropped."""
        seq = self._pop(self._worst)
        entry = self._entries[seq]
        if len(entry.blocks) <= excess:
            return len(self._remove(seq).blocks)
        tail = entry.blocks[-excess:]
        for b in tail:
            del self._by_hash[entry.chain[b]]
        entry.blocks = entry.blocks[:-excess]
        entry.chain = entry.chain[: entry.blocks[-1] + 1]
        entry.version += 1
        self.num_blocks -= excess
        self._push(seq, entry)
        return excess

    def _remove(self, seq: int) -> Deferred:
        entry = self._entries.pop(seq)
        for b in entry.blocks:
            del self._by_hash[entry.chain[b]]
        self.num_blocks -= len(entry.blocks)
        return entry

    def _compact(self) -> None:
        """Rebuild the heaps once stale items outnumber live ones."""
        live = len(self._entries)
        if len(self._best) + len(self._worst) > 4 * live + 64:
            self._best, self._worst = [], []
            for seq, entry in self._entries.items():
                self._push(seq, entry)
