"""The eviction candidates of the L2 index, in policy order, kept incrementally.

Candidates are the host-backed non-root leaves; those not pinned are eligible.
Order is a heap of (policy key, node id, node) entries, one pushed whenever a
leaf appears, is unpinned, or has its statistics changed (``offer``). Entries
are never updated in place: an entry whose node is no longer an eligible
leaf, or whose key is no longer the node's current key, is stale and skipped
by ``pop``; when stale entries outnumber eligible leaves the heap is rebuilt.
So ``pop`` returns exactly what sorting the eligible leaves by (key, node id)
would put first, at O(log n) per node whatever L2's size. Pure module.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from vllm_hicache.index.node import RadixNode
from vllm_hicache.policy.eviction import EvictionPolicy

# Stale entries tolerated beyond twice the leaves before a rebuild (a small
# tree would otherwise rebuild on nearly every offer).
_SLACK = 64


class EvictionQueue:
    """Owned by ``HiRadixTree``, which tells it every change of leafhood,
    pins and node statistics; it never mutates a node."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._leaves: set[RadixNode] = set()
        self._heap: list[tuple[object, int, RadixNode]] = []

    def __contains__(self, node: RadixNode) -> bool:
        return node in self._leaves

    def __iter__(self) -> Iterator[RadixNode]:
        return iter(self._leaves)

    @property
    def num_entries(self) -> int:
        """Heap entries, stale ones included (tests of the queue's upkeep)."""
        return len(self._heap)

    def add(self, node: RadixNode) -> None:
        """``node`` became a host-backed leaf."""
        self._leaves.add(node)
        self.offer(node)

    def discard(self, node: RadixNode) -> None:
        """``node`` stopped being a leaf (got a child, left the tree)."""
        self._leaves.discard(node)

    def offer(self, node: RadixNode) -> None:
        """``node`` was unpinned, or its statistics changed."""
        if node.lock_ref or node not in self._leaves:
            return  # offered again when it is unpinned or becomes a leaf
        heapq.heappush(self._heap, (self.policy.priority(node), node.id, node))
        if len(self._heap) > 2 * len(self._leaves) + _SLACK:
            self.rebuild()

    def pop(self) -> RadixNode | None:
        """The eligible leaf that goes first (its entry is consumed: ``offer``
        it again if it stays), or None when there is none."""
        key = self.policy.priority
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            node = entry[2]
            if node.lock_ref or node not in self._leaves or key(node) != entry[0]:
                continue  # stale: pinned, gone, or re-offered with a new key
            return node
        return None

    def rebuild(self) -> None:
        """One entry per eligible leaf, nothing stale."""
        key = self.policy.priority
        self._heap = [(key(n), n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(self._heap)
