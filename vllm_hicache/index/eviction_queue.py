"""The eviction candidates of the L2 index, in policy order, kept incrementally.

Candidates are the host-backed non-root leaves (``NodeStore.queued``); those
not pinned are eligible. Every offer (a leaf appears, is unpinned, or has its
statistics changed) records an entry (policy key, node serial, node id).
Entries are never updated in place: one whose node is no longer an eligible
leaf, whose slot now holds a later node (another serial), or whose key is no
longer the node's current key is stale and skipped by ``pop``; when entries
outnumber twice the candidates the queue is rebuilt from the candidates.
So ``pop`` returns exactly what sorting the eligible leaves by (key, serial)
would put first.

Entries live in two places. Most offers carry a key at or beyond the
largest queued one (LRU and FIFO stamp the clock; ``rebuild`` sorts all) or
below the smallest (MRU and FILO after a pop): those go to a sorted run of
flat arrays, 28 bytes an entry with no Python object, appended at its end or
written just before its head. The others (a parent exposed by an eviction,
a touched LFU leaf) go to a heap of tuples. ``pop`` takes the smaller of the
run's head and the heap's top: O(1) or O(log n) whatever L2's size.

A policy key is a number or a tuple of one or two numbers (policy/eviction.py);
it is held as two floats. Pure module.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator

from vllm_hicache.index.node import NodeStore
from vllm_hicache.policy.eviction import EvictionPolicy

# Stale entries tolerated beyond twice the leaves before a rebuild (a small
# tree would otherwise rebuild on nearly every offer).
_SLACK = 64
# Consumed run entries kept before the run's head is compacted away.
_MIN_COMPACT = 1024

Entry = tuple[float, float, int, int]  # key, key's second part, serial, node


class _Stats:
    """A node's statistics as the policy reads them (``EvictableNode``);
    one instance, refilled for each key."""

    __slots__ = ("last_access_time", "creation_time", "hit_count", "priority")
    last_access_time: float
    creation_time: float
    hit_count: int
    priority: int


class EvictionQueue:
    """Owned by ``HiRadixTree``, which tells it every change of leafhood,
    pins and node statistics; it writes only ``NodeStore.queued``."""

    def __init__(self, policy: EvictionPolicy, store: NodeStore) -> None:
        self.policy = policy
        self._priority = policy.priority
        self._store = store
        self._num_leaves = 0
        self._stats = _Stats()
        # The sorted run: entries [_head, len) ascending by (k1, k2, serial).
        self._k1 = array("d")
        self._k2 = array("d")
        self._serial = array("q")
        self._node = array("i")
        self._head = 0
        self._heap: list[Entry] = []

    def __contains__(self, node: int) -> bool:
        return bool(self._store.queued[node])

    def __iter__(self) -> Iterator[int]:
        queued = self._store.queued
        node = queued.find(1)
        while node >= 0:
            yield node
            node = queued.find(1, node + 1)

    def __len__(self) -> int:
        return self._num_leaves

    @property
    def num_entries(self) -> int:
        """Entries, stale ones included (tests of the queue's upkeep)."""
        return len(self._node) - self._head + len(self._heap)

    def key(self, node: int) -> tuple[float, float]:
        """The policy's key of ``node`` now, as two floats."""
        store, stats = self._store, self._stats
        stats.last_access_time = store.last_access_time[node]
        stats.creation_time = store.creation_time[node]
        stats.hit_count = store.hit_count[node]
        stats.priority = store.priority[node]
        key = self._priority(stats)
        if type(key) is float:  # LRU, FIFO, MRU, FILO
            return key, 0.0
        if isinstance(key, tuple):
            if len(key) == 2:  # LFU, priority
                return float(key[0]), float(key[1])
            if len(key) == 1:
                return float(key[0]), 0.0
            raise TypeError(f"eviction policy {type(self.policy).__name__} returned a key of "
                            f"{len(key)} numbers; at most two are supported")
        return float(key), 0.0

    def add(self, node: int) -> None:
        """``node`` became a host-backed leaf."""
        queued = self._store.queued
        if not queued[node]:
            queued[node] = 1
            self._num_leaves += 1
        self.offer(node)

    def discard(self, node: int) -> None:
        """``node`` stopped being a leaf (got a child, left the tree)."""
        queued = self._store.queued
        if queued[node]:
            queued[node] = 0
            self._num_leaves -= 1

    def offer(self, node: int) -> None:
        """``node`` was unpinned, or its statistics changed."""
        store = self._store
        if store.lock_ref[node] or not store.queued[node]:
            return  # offered again when it is unpinned or becomes a leaf
        k1, k2 = self.key(node)
        serial = store.serial[node]
        run_k1 = self._k1
        head, end = self._head, len(run_k1)
        if head == end:  # the run is empty: start it afresh
            if end:
                self._truncate(end)
            self._append(k1, k2, serial, node)
        elif k1 > run_k1[-1] or (k1 == run_k1[-1]
                                 and (k2, serial) > (self._k2[-1], self._serial[-1])):
            self._append(k1, k2, serial, node)
        elif head and (k1, k2, serial) < (run_k1[head], self._k2[head], self._serial[head]):
            head -= 1
            run_k1[head], self._k2[head], self._serial[head], self._node[head] = \
                k1, k2, serial, node
            self._head = head
        else:
            heapq.heappush(self._heap, (k1, k2, serial, node))
        if len(self._node) - self._head + len(self._heap) > 2 * self._num_leaves + _SLACK:
            self.rebuild()

    def pop(self) -> int | None:
        """The eligible leaf that goes first (its entry is consumed: ``offer``
        it again if it stays), or None when there is none."""
        store = self._store
        heap = self._heap
        k1s, k2s, serials, nodes = self._k1, self._k2, self._serial, self._node
        while True:
            head = self._head
            if head < len(nodes):
                entry = (k1s[head], k2s[head], serials[head], nodes[head])
                if heap and heap[0] < entry:
                    entry = heapq.heappop(heap)
                else:
                    self._head = head + 1
                    if head >= _MIN_COMPACT and 2 * head >= len(nodes):
                        self._truncate(head + 1)
            elif heap:
                entry = heapq.heappop(heap)
            else:
                return None
            k1, k2, serial, node = entry
            if (store.serial[node] != serial or not store.queued[node]
                    or store.lock_ref[node] or self.key(node) != (k1, k2)):
                continue  # stale: gone, pinned, or re-offered with a new key
            return node

    def rebuild(self) -> None:
        """One entry per eligible leaf, nothing stale, all in the run."""
        store = self._store
        entries = sorted((*self.key(node), store.serial[node], node)
                         for node in self if store.lock_ref[node] == 0)
        self._k1 = array("d", [e[0] for e in entries])
        self._k2 = array("d", [e[1] for e in entries])
        self._serial = array("q", [e[2] for e in entries])
        self._node = array("i", [e[3] for e in entries])
        self._head = 0
        self._heap = []

    def entries(self) -> list[Entry]:
        """Every entry, stale ones included (integrity checks)."""
        head = self._head
        run = zip(self._k1[head:], self._k2[head:], self._serial[head:], self._node[head:])
        return [*run, *self._heap]

    def _append(self, k1: float, k2: float, serial: int, node: int) -> None:
        self._k1.append(k1)
        self._k2.append(k2)
        self._serial.append(serial)
        self._node.append(node)

    def _truncate(self, num: int) -> None:
        """Drop the first ``num`` run entries (consumed ones)."""
        del self._k1[:num], self._k2[:num], self._serial[:num], self._node[:num]
        self._head -= num
