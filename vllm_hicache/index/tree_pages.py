"""Node storage and page accounting of HiRadixTree (the base class).

Owns the root, the free-page stack, the set of host-backed leaves and the page
counters, and every mutation that moves pages into or out of nodes: fill,
alloc/free, evict (leaf-first, policy order, tail trimming) and clear. The
lookup/insert/lock half lives in radix.py. Pure module.

Eviction order is kept incrementally, so evicting costs O(log n) per node
whatever L2's size: a heap of (policy key, node id, node) entries, one pushed
whenever a leaf appears, is unpinned, or has its statistics changed
(``_offer``). Entries are never updated in place: a popped entry whose node is
no longer an unpinned leaf, or whose key is no longer the node's current key,
is stale and skipped; when stale entries outnumber live candidates the heap
is rebuilt. The order is exactly that of sorting the unpinned leaves by
(key, node id) at the moment of eviction.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from vllm_hicache.index.free_pages import FreePages
from vllm_hicache.index.integrity import check_index
from vllm_hicache.index.node import RadixNode, page_run
from vllm_hicache.policy.eviction import EvictionPolicy


class TreePages:
    """Pages in and out of the tree. Only ``HiRadixTree`` subclasses this."""

    def __init__(
        self,
        num_pages: int,
        policy: EvictionPolicy,
        clock: Callable[[], float],
        on_evict: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self.policy = policy
        self._clock = clock
        self._on_evict = on_evict
        self._free = FreePages(num_pages)
        # The root is host-backed with no blocks, so it never looks like a
        # placeholder; it is never locked, evicted or a member of _leaves.
        self._root = RadixNode(None, [], page_run(()), clock())
        # Host-backed non-root nodes without children: the eviction candidates.
        self._leaves: set[RadixNode] = set()
        # Candidates in policy order, with stale entries (see module doc).
        self._heap: list[tuple[object, int, RadixNode]] = []
        # Tops of subtrees cut off by ``invalidate`` while pinned (see node.py).
        self._orphans: set[RadixNode] = set()
        self._num_cached_pages = 0
        self._num_locked_pages = 0

    # --- sizes ----------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached_pages

    @property
    def num_locked_pages(self) -> int:
        return self._num_locked_pages

    def allocated_pages(self) -> frozenset[int]:
        """Pages handed out by ``alloc`` and neither inserted nor freed yet."""
        return frozenset(self._free.allocated)

    # --- pages ----------------------------------------------------------

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` free pages, evicting if short; None if still short.

        Pages evicted by a failed alloc stay evicted. The caller must
        ``insert`` or ``free`` every page it gets.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        short = num_pages - len(self._free)
        if short > 0:
            self.evict(short)
            if len(self._free) < num_pages:
                return None
        return self._free.take(num_pages)

    def alloc_up_to(self, num_pages: int) -> list[int]:
        """Take as many free pages as eviction can find, at most ``num_pages``.

        Never evicts a pinned page: when too few unpinned pages exist the
        caller simply gets fewer (stores less).
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        short = num_pages - len(self._free)
        if short > 0:
            self.evict(short)
        return self._free.take(min(num_pages, len(self._free)))

    def free(self, pages: Sequence[int]) -> None:
        """Give back pages from ``alloc`` that were never inserted."""
        self._free.give_back(pages)

    def _fill(self, node: RadixNode, pages: Sequence[int | None], now: float) -> None:
        """A placeholder's blocks got pages: it becomes host-backed."""
        node.pages = page_run(pages)  # type: ignore[arg-type]
        self._free.claim(node.pages)
        self._num_cached_pages += len(node.pages)
        if node.lock_ref:
            self._num_locked_pages += len(node.pages)
        node.creation_time = now
        if not node.children:  # a locked placeholder whose children were evicted
            self._add_leaf(node)

    # --- eviction -------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked leaves; return how many.

        Leaves leave in policy order (smallest key first, then oldest node);
        a parent that becomes a leaf is a candidate at once. The last leaf is
        trimmed from its tail so no more than ``num_pages`` are freed.
        """
        if num_pages <= 0:
            return 0
        key = self.policy.priority
        heap = self._heap
        freed, hashes = 0, []
        while freed < num_pages and heap:
            entry = heapq.heappop(heap)
            node = entry[2]
            if node.lock_ref or node not in self._leaves or key(node) != entry[0]:
                continue  # stale: pinned, gone, or re-offered with a new key
            need = num_pages - freed
            if len(node.pages) > need:  # type: ignore[arg-type]
                freed += self._trim_tail(node, need, hashes)
                heapq.heappush(heap, entry)  # still a leaf, same key
                break
            freed += self._drop_pages(node, hashes)
            self._detach(node)  # an exposed parent is offered there
        if hashes and self._on_evict is not None:
            self._on_evict(hashes)
        return freed

    def _add_leaf(self, node: RadixNode) -> None:
        self._leaves.add(node)
        self._offer(node)

    def _offer(self, node: RadixNode) -> None:
        """``node`` became a leaf, was unpinned, or its statistics changed."""
        if node.lock_ref or node not in self._leaves:
            return  # offered again when it is unpinned or becomes a leaf
        heapq.heappush(self._heap, (self.policy.priority(node), node.id, node))
        if len(self._heap) > 2 * len(self._leaves) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        key = self.policy.priority
        self._heap = [(key(n), n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(self._heap)

    def _trim_tail(self, node: RadixNode, num_blocks: int, hashes: list[bytes]) -> int:
        pages = node.pages
        assert pages is not None and 0 < num_blocks < len(pages), node
        self._free.push(pages[-num_blocks:])
        hashes.extend(node.key[-num_blocks:])
        del pages[-num_blocks:]
        del node.key[-num_blocks:]
        self._num_cached_pages -= num_blocks
        return num_blocks

    def _drop_pages(self, node: RadixNode, hashes: list[bytes]) -> int:
        """Free a whole host-backed leaf's pages (the node is then detached)."""
        pages = node.pages
        assert pages is not None and not node.children and node.lock_ref == 0, node
        self._leaves.remove(node)
        self._free.push(pages)
        hashes.extend(node.key)
        self._num_cached_pages -= len(pages)
        return len(pages)

    def _detach(self, node: RadixNode) -> RadixNode | None:
        """Unlink a childless node, pruning placeholders that become childless.

        Returns the host-backed ancestor that became a leaf, if any.
        """
        while True:
            parent = node.parent
            assert parent is not None and not node.children, node
            del parent.children[node.key[0]]  # type: ignore[attr-defined]
            node.parent = None
            if parent is self._root or parent.children:
                return None
            if parent.pages is not None:
                self._add_leaf(parent)
                return parent
            if parent.lock_ref:  # pruned later, by unlock
                return None
            node = parent

    def clear(self) -> None:
        """Drop every unlocked node (reset_cache); locked paths (and pinned
        orphans) stay."""
        freed: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.lock_ref:
                    stack.append(child)
                else:
                    del node.children[child.key[0]]  # type: ignore[attr-defined]
                    self._drop_subtree(child, freed)
            if node is not self._root and not node.children and node.pages is not None:
                self._leaves.add(node)
        self._free.push(freed)
        self._num_cached_pages -= len(freed)
        self._rebuild_heap()

    def _orphan(self, top: RadixNode) -> None:
        """Cut ``top``'s subtree out of the index (it is already unlinked).

        Unpinned, its pages are freed at once; pinned, they stay with their
        pins and are freed by the unlock that releases the last one.
        """
        if top.lock_ref == 0:
            self._free_orphan(top)
            return
        stack = [top]
        while stack:
            node = stack.pop()
            node.orphaned = True
            self._leaves.discard(node)
            stack.extend(node.children.values())
        self._orphans.add(top)

    def _free_orphan(self, top: RadixNode) -> None:
        freed: list[int] = []
        hashes: list[bytes] = []
        stack = [top]
        while stack:
            node = stack.pop()
            if node.pages is not None:
                hashes.extend(node.key)
            stack.extend(node.children.values())
        self._drop_subtree(top, freed)
        self._orphans.discard(top)
        self._free.push(freed)
        self._num_cached_pages -= len(freed)
        if hashes and self._on_evict is not None:
            self._on_evict(hashes)

    def _drop_subtree(self, top: RadixNode, freed: list[int]) -> None:
        top.parent = None
        stack = [top]
        while stack:
            node = stack.pop()
            if node.pages is not None:
                freed.extend(node.pages)
                self._leaves.discard(node)
            stack.extend(node.children.values())

    # --- checks ---------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError, with the numbers, if any invariant is broken."""
        check_index(
            self._root,
            self._free,
            self._leaves,
            self._orphans,
            num_pages=self._num_pages,
            num_cached_pages=self._num_cached_pages,
            num_locked_pages=self._num_locked_pages,
        )
