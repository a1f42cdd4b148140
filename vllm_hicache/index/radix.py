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

The order in which leaves are evicted is kept by ``EvictionQueue``
(eviction_queue.py); pages move between the free stack (free_pages.py) and
the nodes only here. Mutations happen only in the scheduler half,
single-threaded. Pure module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from vllm_hicache.index.eviction_queue import EvictionQueue
from vllm_hicache.index.free_pages import FreePages
from vllm_hicache.index.integrity import check_index
from vllm_hicache.index.node import LockHandle, MatchResult, PinnedPages, RadixNode, page_run
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


class HiRadixTree:
    """Metadata of the L2 pool: match, insert, lock/unlock, alloc/free, evict.

    Called by the scheduler half only; ``match`` is side-effect free, every
    other method may mutate. ``on_evict(hashes)`` is called once per
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
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self.policy = policy
        self._clock = clock
        self._on_evict = on_evict
        self._free = FreePages(num_pages)
        # The root is host-backed with no blocks, so it never looks like a
        # placeholder; it is never locked, evicted or queued for eviction.
        self._root = RadixNode(None, [], page_run(()), clock())
        # Host-backed non-root leaves, in the order they are evicted.
        self._queue = EvictionQueue(policy)
        # Tops of subtrees cut off by ``invalidate`` while pinned (see node.py).
        self._orphans: set[RadixNode] = set()
        self._num_cached_pages = 0
        self._num_locked_pages = 0

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
            self._queue.offer(nodes[-1])  # only a leaf's key matters, and only the last can be one

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
                self._queue.offer(node)  # an unpinned leaf is a candidate again
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
                self._queue.add(parent)
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

    # --- walks (an L3 attached at run time backs up what L2 holds) -------

    def hot_nodes(self) -> list[RadixNode]:
        """Host-backed nodes, hottest first: by the latest use of the node or
        of anything below it (a prefix is as hot as its hottest extension),
        shallower first on ties, so a chain's prefix precedes its extensions.
        A snapshot, O(n log n); ``node_chain`` says what each still holds."""
        visited: list[tuple[RadixNode, int]] = []
        stack = [(child, 1) for child in self._root.children.values()]
        while stack:
            node, depth = stack.pop()
            visited.append((node, depth))
            stack.extend((child, depth + 1) for child in node.children.values())
        heat: dict[int, float] = {}
        for node, _ in reversed(visited):  # every child before its parent
            heat[node.id] = max([node.last_access_time,
                                 *(heat[child.id] for child in node.children.values())])
        ranked = sorted((item for item in visited if item[0].pages is not None),
                        key=lambda item: (-heat[item[0].id], item[1], item[0].id))
        return [node for node, _ in ranked]

    def node_chain(self, node: RadixNode) -> tuple[list[bytes], list[int | None]] | None:
        """The hashes of blocks 0 .. ``node``'s last block, and the page of
        each (None: placeholder); None if ``node`` has left the index
        (evicted, invalidated, cleared) since it was handed out."""
        path: list[RadixNode] = []
        while node is not self._root:
            parent = node.parent
            if parent is None or node.orphaned or parent.children.get(node.key[0]) is not node:
                return None
            path.append(node)
            node = parent
        chain: list[bytes] = []
        pages: list[int | None] = []
        for step in reversed(path):
            chain.extend(step.key)
            pages.extend(step.pages if step.pages is not None else [None] * len(step.key))
        return chain, pages

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
        self._queue.offer(node)  # the deepest node walked: the only one that can be a leaf
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
            self._queue.offer(parent)  # walked through: its statistics changed
            return
        node, i = parent, start
        if parent is not self._root and parent.pages is not None and not parent.children \
                and pages[start] is not None:
            i += self._extend_leaf(parent, hashes, pages, start, stop)
            if i == stop:
                self._queue.offer(parent)  # still a leaf, with new pages and statistics
                return
        self._queue.discard(parent)
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
        self._queue.add(node)

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
            self._queue.add(node)

    # --- eviction -------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked leaves; return how many.

        Leaves leave in policy order (smallest key first, then oldest node);
        a parent that becomes a leaf is a candidate at once. The last leaf is
        trimmed from its tail so no more than ``num_pages`` are freed.
        """
        if num_pages <= 0:
            return 0
        freed, hashes = 0, []
        while freed < num_pages:
            node = self._queue.pop()
            if node is None:
                break
            need = num_pages - freed
            if len(node.pages) > need:  # type: ignore[arg-type]
                freed += self._trim_tail(node, need, hashes)
                self._queue.offer(node)  # still a leaf, same key
                break
            freed += self._drop_pages(node, hashes)
            self._detach(node)  # an exposed parent is offered there
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
        self._queue.discard(node)
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
                self._queue.add(parent)
                return parent
            if parent.lock_ref:  # pruned later, by unlock
                return None
            node = parent

    def clear(self) -> list[bytes]:
        """Drop every unlocked node (reset_cache); locked paths (and pinned
        orphans) stay. Returns the hashes of the blocks whose pages left."""
        freed: list[int] = []
        hashes: list[bytes] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.lock_ref:
                    stack.append(child)
                else:
                    del node.children[child.key[0]]  # type: ignore[attr-defined]
                    self._drop_subtree(child, freed, hashes)
            if node is not self._root and not node.children and node.pages is not None:
                self._queue.add(node)
        self._free.push(freed)
        self._num_cached_pages -= len(freed)
        self._queue.rebuild()
        return hashes

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
            self._queue.discard(node)
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

    def _drop_subtree(self, top: RadixNode, freed: list[int],
                      hashes: list[bytes] | None = None) -> None:
        top.parent = None
        stack = [top]
        while stack:
            node = stack.pop()
            if node.pages is not None:
                freed.extend(node.pages)
                if hashes is not None:
                    hashes.extend(node.key)
                self._queue.discard(node)
            stack.extend(node.children.values())

    # --- checks ---------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError, with the numbers, if any invariant is broken."""
        check_index(
            self._root,
            self._free,
            set(self._queue),
            self._orphans,
            num_pages=self._num_pages,
            num_cached_pages=self._num_cached_pages,
            num_locked_pages=self._num_locked_pages,
        )
