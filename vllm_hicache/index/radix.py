"""HiRadixTree: which chains of vLLM blocks have a page in the L2 host pool.

Keys are vLLM block hashes, chained: the hash of block i names the whole
prefix 0..i. A request is its list of block hashes, block 0 first. The tree
is compressed: a node holds a run of blocks (see node.py), children are keyed
by the first hash of their run, and a node is either all host-backed or all
placeholder. Invariants (checked by ``check_integrity``):

- every page is in exactly one place: free, allocated-not-inserted, or a node;
- placeholders exist only on the path to host-backed nodes: one that loses its
  last child is pruned at once, unless a lock still holds it (then it goes
  when the lock is released);
- a locked node's ancestors are locked at least as many times;
- eviction is leaf-first, so a prefix never leaves before its extensions.

Mutations happen only in the scheduler half, single-threaded. Pure module.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

from vllm_hicache.index.free_pages import FreePages
from vllm_hicache.index.integrity import check_index
from vllm_hicache.index.node import LockHandle, MatchResult, RadixNode
from vllm_hicache.policy.eviction import EvictionPolicy


def _common_len(key: list[bytes], hashes: Sequence[bytes], start: int, stop: int) -> int:
    """Blocks shared by ``key`` and ``hashes[start:stop]``; key[0] already matched."""
    limit = min(len(key), stop - start)
    j = 1
    while j < limit and key[j] == hashes[start + j]:
        j += 1
    return j


def _same_kind_run(pages: Sequence[int | None], start: int, stop: int) -> int:
    """Length of the run at ``start`` that is all-None or all-page."""
    placeholder = pages[start] is None
    j = start + 1
    while j < stop and (pages[j] is None) == placeholder:
        j += 1
    return j - start


class HiRadixTree:
    """Metadata of the L2 pool: match, insert, lock, alloc/evict.

    Called by the scheduler half only. ``on_evict(hashes)`` is called once per
    ``evict``/``alloc`` that evicted something, with the evicted blocks'
    hashes (not by ``clear``: the caller resets its own state there).
    """

    def __init__(
        self,
        num_pages: int,
        policy: EvictionPolicy,
        clock: Callable[[], float] = time.monotonic,
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
        self._root = RadixNode(None, [], [], clock())
        # Host-backed non-root nodes without children: the eviction candidates.
        self._leaves: set[RadixNode] = set()
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

    # --- lookup ---------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> MatchResult:
        """Pages of the longest prefix of ``hashes`` in the tree. No mutation."""
        pages: list[int | None] = []
        node, i, n = self._root, 0, len(hashes)
        while i < n:
            node = node.children.get(hashes[i])  # type: ignore[assignment]
            if node is None:
                break
            key = node.key
            end = i + len(key)
            # Chained hashes: an equal last hash means the whole run matches,
            # so a full node costs one compare instead of one per block.
            if end <= n and key[-1] == hashes[end - 1]:
                j = len(key)
            else:
                j = _common_len(key, hashes, i, n)
            if node.pages is None:
                pages.extend([None] * j)
            else:
                pages.extend(node.pages if j == len(key) else node.pages[:j])
            if j < len(key):
                break
            i = end
        return MatchResult(pages)

    def _path(self, hashes: Sequence[bytes], num_blocks: int) -> tuple[list[RadixNode], int]:
        """Nodes (root excluded) covering blocks [0, num_blocks) and how many they cover."""
        nodes: list[RadixNode] = []
        node, i = self._root, 0
        while i < num_blocks:
            child = node.children.get(hashes[i])
            if child is None:
                break
            j = _common_len(child.key, hashes, i, len(hashes))
            nodes.append(child)
            i += j
            if j < len(child.key):
                break
            node = child
        return nodes, min(i, num_blocks)

    def touch(self, hashes: Sequence[bytes], num_blocks: int, priority: int = 0) -> None:
        """Record a use of blocks [0, num_blocks): access time, hit count, priority.

        Covers whole nodes; stops silently where the tree's path ends.
        """
        nodes, _ = self._path(hashes, min(num_blocks, len(hashes)))
        now = self._clock()
        for node in nodes:
            node.last_access_time = now
            node.hit_count += 1
            if priority > node.priority:
                node.priority = priority

    # --- locks ----------------------------------------------------------

    def lock(self, hashes: Sequence[bytes], num_blocks: int) -> LockHandle:
        """Pin the nodes covering blocks [0, num_blocks) and their ancestors.

        Pinned nodes are never evicted, trimmed or cleared, so their pages stay
        valid until ``unlock``. Raises ValueError if the tree's path is shorter.
        """
        if not 0 <= num_blocks <= len(hashes):
            raise ValueError(f"num_blocks={num_blocks} outside [0, {len(hashes)}]")
        nodes, covered = self._path(hashes, num_blocks)
        if covered < num_blocks:
            raise ValueError(
                f"cannot lock {num_blocks} blocks: the tree holds only {covered} of this chain"
            )
        for node in nodes:
            if node.lock_ref == 0 and node.pages is not None:
                self._num_locked_pages += len(node.pages)
            node.lock_ref += 1
        return LockHandle(nodes[-1] if nodes else self._root, num_blocks)

    def unlock(self, handle: LockHandle) -> None:
        """Release one ``lock``. A second unlock of the same handle raises."""
        if not handle._active:
            raise RuntimeError(f"lock handle for {handle.num_blocks} blocks already unlocked")
        handle._active = False
        node = handle._node
        while node is not self._root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, node
            if node.lock_ref == 0 and node.pages is not None:
                self._num_locked_pages -= len(node.pages)
            node = node.parent  # type: ignore[assignment]
        deepest = handle._node
        if deepest.pages is None and not deepest.children and deepest.lock_ref == 0:
            self._detach(deepest)

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

    def free(self, pages: Sequence[int]) -> None:
        """Give back pages from ``alloc`` that were never inserted."""
        self._free.give_back(pages)

    # --- insert ---------------------------------------------------------

    def insert(
        self, hashes: Sequence[bytes], pages: Sequence[int | None], priority: int = 0
    ) -> list[int]:
        """Insert the chain ``hashes[:len(pages)]``; return the pages not used.

        ``pages[i]`` is an allocated page holding block i, or None where the
        caller stores nothing. A page is unused (returned; the caller frees
        it) where the tree already has a page for that block. Blocks with no
        page anywhere become placeholders, except a trailing run of them,
        which would have no host-backed descendant and is simply not inserted.
        """
        num_blocks = len(pages)
        if num_blocks > len(hashes):
            raise ValueError(f"{num_blocks} pages for a chain of {len(hashes)} blocks")
        self._check_insertable(pages)
        now = self._clock()
        unused: list[int] = []
        node, i = self._root, 0
        while i < num_blocks:
            child = node.children.get(hashes[i])
            if child is None:
                self._add_chain(node, hashes, pages, i, now, priority)
                break
            m = _common_len(child.key, hashes, i, num_blocks)
            if child.pages is None:
                m = _same_kind_run(pages, i, i + m)
            if m < len(child.key):
                child = child.split(m)
            if child.pages is not None:
                unused.extend(p for p in pages[i : i + m] if p is not None)
                child.hit_count += 1
            elif pages[i] is not None:
                self._fill(child, pages[i : i + m], now)
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            node, i = child, i + m
        return unused

    def _check_insertable(self, pages: Sequence[int | None]) -> None:
        given = [p for p in pages if p is not None]
        if len(set(given)) != len(given) or not self._free.allocated.issuperset(given):
            bad = sorted(p for p in given if p not in self._free.allocated)
            raise ValueError(
                f"insert() pages must be distinct and allocated; not allocated: {bad}"
            )

    def _fill(self, node: RadixNode, pages: Sequence[int | None], now: float) -> None:
        """A placeholder's blocks got pages: it becomes host-backed."""
        node.pages = list(pages)  # type: ignore[arg-type]
        self._free.claim(node.pages)
        self._num_cached_pages += len(node.pages)
        if node.lock_ref:
            self._num_locked_pages += len(node.pages)
        node.creation_time = now
        if not node.children:  # a locked placeholder whose children were evicted
            self._leaves.add(node)

    def _add_chain(
        self,
        parent: RadixNode,
        hashes: Sequence[bytes],
        pages: Sequence[int | None],
        start: int,
        now: float,
        priority: int,
    ) -> None:
        """New nodes for blocks [start, len(pages)) below ``parent``."""
        stop = len(pages)
        while stop > start and pages[stop - 1] is None:
            stop -= 1
        if stop == start:
            return
        self._leaves.discard(parent)
        node, i = parent, start
        while i < stop:
            m = _same_kind_run(pages, i, stop)
            run = None if pages[i] is None else list(pages[i : i + m])
            child = RadixNode(node, list(hashes[i : i + m]), run, now, priority)  # type: ignore[arg-type]
            node.children[child.key[0]] = child
            if run is not None:
                self._free.claim(run)  # type: ignore[arg-type]
                self._num_cached_pages += m
            node, i = child, i + m
        self._leaves.add(node)

    # --- eviction -------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked leaves; return how many.

        Leaves leave in policy order (smallest key first); a parent that
        becomes a leaf joins the heap. The last leaf is trimmed from its tail
        so no more than ``num_pages`` are freed.
        """
        if num_pages <= 0:
            return 0
        key = self.policy.priority
        heap = [(key(n), n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed, hashes = 0, []
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[2]
            need = num_pages - freed
            if len(node.pages) > need:  # type: ignore[arg-type]
                freed += self._trim_tail(node, need, hashes)
                break
            freed += self._drop_pages(node, hashes)
            exposed = self._detach(node)
            if exposed is not None and exposed.lock_ref == 0:
                heapq.heappush(heap, (key(exposed), exposed.id, exposed))
        if hashes and self._on_evict is not None:
            self._on_evict(hashes)
        return freed

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
            del parent.children[node.key[0]]
            node.parent = None
            if parent is self._root or parent.children:
                return None
            if parent.pages is not None:
                self._leaves.add(parent)
                return parent
            if parent.lock_ref:  # pruned later, by unlock
                return None
            node = parent

    def clear(self) -> None:
        """Drop every unlocked node (reset_cache); locked paths stay."""
        freed: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.lock_ref:
                    stack.append(child)
                else:
                    del node.children[child.key[0]]
                    self._drop_subtree(child, freed)
            if node is not self._root and not node.children and node.pages is not None:
                self._leaves.add(node)
        self._free.push(freed)
        self._num_cached_pages -= len(freed)

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
            num_pages=self._num_pages,
            num_cached_pages=self._num_cached_pages,
            num_locked_pages=self._num_locked_pages,
        )
