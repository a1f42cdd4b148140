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
- eviction is leaf-first, so a prefix never leaves before its extensions;
- an invalidated subtree is unreachable at once; while pinned it survives
  as an orphan (its pages neither free nor matchable), freed by the unlock
  that releases its last pin.

Mutations happen only in the scheduler half, single-threaded. Pure module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from vllm_hicache.index.node import LockHandle, MatchResult, PinnedPages, RadixNode, page_run
from vllm_hicache.index.tree_pages import TreePages
from vllm_hicache.policy.eviction import EvictionPolicy


def _common_len(key: list[bytes], hashes: Sequence[bytes], start: int, stop: int) -> int:
    """Blocks shared by ``key`` and ``hashes[start:stop]``; key[0] already matched."""
    end = start + len(key)
    # Chained hashes: an equal last hash means the whole run matches, so a
    # fully matched node costs one compare instead of one per block.
    if end <= stop and key[-1] == hashes[end - 1]:
        return len(key)
    limit = min(len(key), stop - start)
    j = 1
    while j < limit and key[j] == hashes[start + j]:
        j += 1
    return j


def _subtree_pages(top: RadixNode) -> int:
    num_pages, stack = 0, [top]
    while stack:
        node = stack.pop()
        num_pages += len(node.pages or ())
        stack.extend(node.children.values())
    return num_pages


def _same_kind_run(pages: Sequence[int | None], start: int, stop: int) -> int:
    """Length of the run at ``start`` that is all-None or all-page."""
    placeholder = pages[start] is None
    j = start + 1
    while j < stop and (pages[j] is None) == placeholder:
        j += 1
    return j - start


class HiRadixTree(TreePages):
    """Metadata of the L2 pool: match, insert, lock/unlock, alloc/free, evict.

    Called by the scheduler half only; ``match`` is side-effect free, every
    other method may mutate. Page accounting and eviction (``alloc``,
    ``free``, ``evict``, ``clear``, ``check_integrity`` and the ``num_*``
    sizes) come from ``TreePages``. ``on_evict(hashes)`` is called once per
    ``evict``/``alloc`` that evicted something, with the evicted blocks'
    hashes; ``clear`` does not call it (the caller resets its own state).
    """

    def __init__(
        self,
        num_pages: int,
        policy: EvictionPolicy,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        super().__init__(num_pages, policy, clock, on_evict)

    # --- lookup ---------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> MatchResult:
        """Pages of the longest prefix of ``hashes`` in the tree. No mutation."""
        pages: list[int | None] = []
        node, i, n = self._root, 0, len(hashes)
        while i < n:
            node = node.children.get(hashes[i])  # type: ignore[assignment]
            if node is None:
                break
            j = _common_len(node.key, hashes, i, n)
            if node.pages is None:
                pages.extend([None] * j)
            else:
                pages.extend(node.pages if j == len(node.key) else node.pages[:j])
            if j < len(node.key):
                break
            i += j
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
        if nodes and self.policy.keyed_by_use:
            self._offer(nodes[-1])  # only a leaf's key matters, and only the last can be one

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
        """Release one ``lock``. A second unlock of the same handle raises.

        The release that drops an orphan's last pin frees its pages; a
        placeholder left without children and pins is pruned.
        """
        if not handle._active:
            raise RuntimeError(f"lock handle for {handle.num_blocks} blocks already unlocked")
        handle._active = False
        node = handle._node
        # One walk can free several orphans: one cut below another on the
        # same chain still hangs from a node inside the upper one.
        released_orphans: list[RadixNode] = []
        prune: RadixNode | None = None
        while node is not self._root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, node
            if node.lock_ref == 0:
                if node.pages is not None:
                    self._num_locked_pages -= len(node.pages)
                self._offer(node)  # an unpinned leaf is a candidate again
                if node in self._orphans:
                    released_orphans.append(node)
                elif (prune is None and not node.orphaned and node.pages is None
                      and not node.children):
                    prune = node
            node = node.parent  # type: ignore[assignment]
        for orphan in released_orphans:
            self._free_orphan(orphan)
        if prune is not None:
            self._detach(prune)

    def invalidate(self, hashes: Sequence[bytes], block: int) -> int:
        """Drop block ``block`` of this chain, and every block below it, from
        the index: a page whose content is wrong (its copy failed) must never
        be a hit again. Pinned pages are freed when their last pin goes.
        Returns how many pages left the index (0: the block was not there).
        """
        if not 0 <= block < len(hashes):
            raise ValueError(f"block={block} outside [0, {len(hashes)})")
        nodes, covered = self._path(hashes, block + 1)
        if covered <= block:
            return 0
        node = nodes[-1]
        offset = block - sum(len(n.key) for n in nodes[:-1])
        if offset > 0:
            node.split(offset)  # ``node`` keeps the tail that starts at ``block``
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[0]]  # type: ignore[attr-defined]
        num_pages = _subtree_pages(node)
        self._orphan(node)  # keeps node.parent while pinned: unlock walks through it
        if parent is not self._root and not parent.children:
            if parent.pages is not None:
                self._add_leaf(parent)
            elif parent.lock_ref == 0:
                self._detach(parent)
        return num_pages

    def pinned_pages(self) -> PinnedPages:
        """Pages of pinned nodes, indexed or orphaned. O(tree size): checks only."""
        indexed: set[int] = set()
        orphaned: set[int] = set()
        stack = [*self._root.children.values(), *self._orphans]
        while stack:
            node = stack.pop()
            if node.lock_ref and node.pages is not None:
                (orphaned if node.orphaned else indexed).update(node.pages)
            stack.extend(node.children.values())
        return PinnedPages(frozenset(indexed), frozenset(orphaned))

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
                return unused  # it offered the leaf it made or grew
            m = _common_len(child.key, hashes, i, num_blocks)
            if child.pages is None:
                m = _same_kind_run(pages, i, i + m)
            if m < len(child.key):
                child = child.split(m)
            if child.pages is not None:
                given = pages[i : i + m]
                # count() runs in C: a long matched prefix with no pages
                # given (the usual store) costs no Python loop.
                if given.count(None) != m:
                    unused.extend(p for p in given if p is not None)
                child.hit_count += 1
            elif pages[i] is not None:
                self._fill(child, pages[i : i + m], now)
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            node, i = child, i + m
        self._offer(node)  # the deepest node walked: the only one that can be a leaf
        return unused

    def _check_insertable(self, pages: Sequence[int | None]) -> None:
        # Set operations and count() run in C: a long chain of None (blocks
        # the caller does not store) costs no Python loop.
        given = set(pages)
        given.discard(None)
        num_given = len(pages) - pages.count(None)
        if len(given) != num_given or not self._free.allocated.issuperset(given):
            bad = sorted(p for p in given if p not in self._free.allocated)
            raise ValueError(
                f"insert() pages must be distinct and allocated; not allocated: {bad}"
            )

    def _add_chain(
        self,
        parent: RadixNode,
        hashes: Sequence[bytes],
        pages: Sequence[int | None],
        start: int,
        now: float,
        priority: int,
    ) -> None:
        """New nodes for blocks [start, len(pages)) below ``parent``.

        A host-backed leaf grows in place instead: a chain stored piece by
        piece (chunked prefill, one block per decode step) stays one node, so
        later walks cost one step per branch point, not one per piece.
        """
        stop = len(pages)
        while stop > start and pages[stop - 1] is None:
            stop -= 1
        if stop == start:
            self._offer(parent)  # walked through: its statistics changed
            return
        node, i = parent, start
        if parent is not self._root and parent.pages is not None and not parent.children \
                and pages[start] is not None:
            i += self._extend_leaf(parent, hashes, pages, start, stop)
            if i == stop:
                self._offer(parent)  # still a leaf, with new pages and statistics
                return
        self._leaves.discard(parent)
        while i < stop:
            m = _same_kind_run(pages, i, stop)
            run = None
            if pages[i] is not None:
                run = page_run(pages[i : i + m])  # type: ignore[arg-type]
                self._free.claim(run)
                self._num_cached_pages += m
            child = RadixNode(node, list(hashes[i : i + m]), run, now, priority)
            node.adopt(child)
            node, i = child, i + m
        self._add_leaf(node)

    def _extend_leaf(self, leaf: RadixNode, hashes: Sequence[bytes],
                     pages: Sequence[int | None], start: int, stop: int) -> int:
        """Append the host-backed run at ``start`` to ``leaf``; return its length.

        A pin on the leaf covers the new pages too (pins hold whole nodes).
        """
        m = _same_kind_run(pages, start, stop)
        run: list[int] = list(pages[start : start + m])  # type: ignore[arg-type]
        self._free.claim(run)
        leaf.key.extend(hashes[start : start + m])
        leaf.pages.extend(run)  # type: ignore[union-attr]
        self._num_cached_pages += m
        if leaf.lock_ref:
            self._num_locked_pages += m
        return m
