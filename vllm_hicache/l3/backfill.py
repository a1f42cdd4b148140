"""Backfill after a runtime attach: what L2 held when L3 was attached is
backed up in the background, hottest first (``HiRadixTree.hot_nodes``), a
bounded number of pages a step and in flight (admin/clear.py drives it).

A node's objects are keyed by the node's own block hashes, vLLM's chained
hashes, the very ones a later lookup passes to ``KeyNamespace.object_keys``;
each range pins the node's whole chain from the root
(``HiRadixTree.node_chain``), as a store's backup does. A block hash is
queued at most once: a chain's prefix is shared by many nodes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm_hicache.common.page_ops import PinnedRange

if TYPE_CHECKING:
    from vllm_hicache.index import HiRadixTree
    from vllm_hicache.l3.planner import L3Planner


class Backfill:
    """Backs up to L3 what L2 held when L3 was attached, hottest first."""

    def __init__(self, nodes: list, pages_per_step: int, max_inflight_pages: int) -> None:
        self._nodes = nodes
        self._next = 0
        # Block hashes queued already (a chain's prefix is shared by many nodes).
        self._queued: set[bytes] = set()
        self._open: dict[int, int] = {}  # backup op id -> pages
        self.pages_per_step = pages_per_step
        self.max_inflight_pages = max_inflight_pages
        self.queued_pages = 0
        self.started = time.monotonic()

    @property
    def pending(self) -> bool:
        return self._next < len(self._nodes)

    def inflight_pages(self, planner: L3Planner) -> int:
        for op_id in [o for o in self._open if not planner.backups.is_backup_open(o)]:
            del self._open[op_id]
        return sum(self._open.values())

    def can_plan(self, planner: L3Planner) -> bool:
        return self.pending and self.inflight_pages(planner) < self.max_inflight_pages

    def done(self, planner: L3Planner) -> bool:
        return not self.pending and self.inflight_pages(planner) == 0

    def next_ranges(self, tree: HiRadixTree, budget: int) -> list[PinnedRange]:
        """Up to ``budget`` pages not queued yet, node by node."""
        ranges: list[PinnedRange] = []
        while budget > 0 and self.pending:
            found = tree.node_chain(self._nodes[self._next])
            if found is None:  # evicted or invalidated since the snapshot
                self._next += 1
                continue
            chain, pages = found
            picked = [(i, page) for i, page in enumerate(pages)
                      if page is not None and chain[i] not in self._queued]
            if len(picked) > budget:
                picked = picked[:budget]  # the rest of this node next time
            else:
                self._next += 1
            if not picked:
                continue
            blocks = tuple(i for i, _ in picked)
            self._queued.update(chain[i] for i in blocks)
            ranges.append(PinnedRange(tuple(chain[: blocks[-1] + 1]), blocks,
                                      tuple(page for _, page in picked)))
            budget -= len(blocks)
        return ranges

    def opened(self, op_id: int, num_pages: int) -> None:
        self._open[op_id] = num_pages
        self.queued_pages += num_pages

    def report(self, planner: L3Planner | None) -> dict[str, Any]:
        return {
            "nodes_total": len(self._nodes), "nodes_left": len(self._nodes) - self._next,
            "pages_queued": self.queued_pages,
            "pages_in_flight": self.inflight_pages(planner) if planner is not None else 0,
        }
