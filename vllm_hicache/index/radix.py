"""HiRadixTree: which chains of vLLM blocks have a page in the L2 host pool.

Keys are vLLM block hashes, chained: the hash of block i names the whole
prefix 0..i. A request is its list of block hashes, block 0 first. The tree
is compressed: a node holds a run of blocks (see node.py: nodes are ids into
flat arrays), a child is found by (parent, first hash of its run) in one
table for the whole tree (child_index.py), and a node is either all
host-backed or all placeholder. Invariants (checked by ``check_integrity``):

- every page is in exactly one place: free, allocated-not-inserted, or a node;
- placeholders exist only on the path to host-backed nodes: one that loses its
  last child is pruned at once, unless a lock still holds it (then it goes
  when the lock is released);
- a locked node's ancestors are locked at least as many times;
- eviction is leaf-first, so a prefix never leaves before its extensions;
- an invalidated subtree is unreachable at once; while pinned it survives
  as an orphan (its pages neither free nor matchable), freed by the unlock
  that releases its last pin;
- a node is in the child index exactly while it is reachable, and its slot
  is released only once it is unreachable and unpinned.

The order in which leaves are evicted is kept by ``EvictionQueue``
(eviction_queue.py); pages move between the free stack (free_pages.py) and
the nodes only here. Mutations happen only in the scheduler half,
single-threaded. Pure module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

from vllm_hicache.index.child_index import ChildIndex
from vllm_hicache.index.eviction_queue import EvictionQueue
from vllm_hicache.index.free_pages import FreePages
from vllm_hicache.index.integrity import check_index
from vllm_hicache.index.node import (
    IN_RUN,
    NO_NODE,
    PLACEHOLDER,
    ROOT,
    LockHandle,
    MatchResult,
    NodeRef,
    NodeStore,
    NodeView,
    PinnedPages,
    page_run,
)
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
        # The root (node 0) is host-backed with no blocks, so it never looks
        # like a placeholder; it is never locked, evicted or queued.
        self._nodes = NodeStore(clock())
        self._index = ChildIndex(self._nodes)
        # Host-backed non-root leaves, in the order they are evicted.
        self._queue = EvictionQueue(policy, self._nodes)
        # Tops of subtrees cut off by ``invalidate`` while pinned (see node.py).
        self._orphans: set[int] = set()
        self._num_cached_pages = 0
        self._num_locked_pages = 0

    # --- lookup ---------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> MatchResult:
        """Pages of the longest prefix of ``hashes`` in the tree. No mutation."""
        find = self._index.find
        store = self._nodes
        keys, page_of = store.key, store.page
        pages: list[int | None] = []
        node, i, n = ROOT, 0, len(hashes)
        while i < n:
            node = find(node, hashes[i])
            if node == NO_NODE:
                break
            key = keys[node]
            if type(key) is not list:  # one block
                page = page_of[node]
                pages.append(None if page == PLACEHOLDER else page)
                i += 1
                continue
            j = _common_len(key, hashes, i, n)
            if page_of[node] == PLACEHOLDER:
                pages.extend([None] * j)
            else:
                run = store.runs[node]
                pages.extend(run if j == len(key) else run[:j])
            if j < len(key):
                break
            i += j
        return MatchResult(pages)

    def _path(self, hashes: Sequence[bytes], num_blocks: int) -> tuple[list[int], int]:
        """Nodes (root excluded) covering blocks [0, num_blocks) and how many they cover."""
        find = self._index.find
        keys = self._nodes.key
        nodes: list[int] = []
        node, i = ROOT, 0
        while i < num_blocks:
            child = find(node, hashes[i])
            if child == NO_NODE:
                break
            nodes.append(child)
            key = keys[child]
            if type(key) is not list:
                i += 1
                node = child
                continue
            j = _common_len(key, hashes, i, len(hashes))
            i += j
            if j < len(key):
                break
            node = child
        return nodes, min(i, num_blocks)

    def touch(self, hashes: Sequence[bytes], num_blocks: int, priority: int = 0) -> None:
        """Record a use of blocks [0, num_blocks): access time, hit count, priority.

        Covers whole nodes; stops silently where the tree's path ends.
        """
        nodes, _ = self._path(hashes, min(num_blocks, len(hashes)))
        now = self._clock()
        store = self._nodes
        last, hits, prio = store.last_access_time, store.hit_count, store.priority
        for node in nodes:
            last[node] = now
            hits[node] += 1
            if priority > prio[node]:
                prio[node] = priority
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
        store = self._nodes
        lock_ref = store.lock_ref
        for node in nodes:
            if lock_ref[node] == 0:
                self._num_locked_pages += store.num_pages(node)
            lock_ref[node] += 1
        return LockHandle(nodes[-1] if nodes else ROOT, num_blocks)

    def unlock(self, handle: LockHandle) -> None:
        """Release one ``lock``. A second unlock of the same handle raises.

        The release that drops an orphan's last pin frees its pages; a
        placeholder left without children and pins is pruned.
        """
        if not handle._active:
            raise RuntimeError(f"lock handle for {handle.num_blocks} blocks already unlocked")
        handle._active = False
        store = self._nodes
        lock_ref = store.lock_ref
        node = handle._node
        # One walk can free several orphans: one cut below another on the
        # same chain still hangs from a node inside the upper one.
        released_orphans: list[int] = []
        prune = NO_NODE
        while node != ROOT:
            lock_ref[node] -= 1
            assert lock_ref[node] >= 0, store.describe(node)
            if lock_ref[node] == 0:
                self._num_locked_pages -= store.num_pages(node)
                self._queue.offer(node)  # an unpinned leaf is a candidate again
                if node in self._orphans:
                    released_orphans.append(node)
                elif (prune == NO_NODE and not store.orphaned[node]
                      and store.page[node] == PLACEHOLDER
                      and store.first_child[node] == NO_NODE):
                    prune = node
            node = store.parent[node]
        for orphan in released_orphans:
            self._free_orphan(orphan)
        if prune != NO_NODE:
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
        store = self._nodes
        node = nodes[-1]
        offset = block - sum(store.num_blocks(n) for n in nodes[:-1])
        if offset > 0:
            self._split(node, offset)  # ``node`` keeps the tail that starts at ``block``
        parent = store.parent[node]
        self._unlink(node)  # keeps its parent link while pinned: unlock walks through it
        subtree = store.subtree(node)
        num_pages = sum(store.num_pages(n) for n in subtree)
        self._orphan(node, subtree)
        if parent != ROOT and store.first_child[parent] == NO_NODE:
            if store.page[parent] != PLACEHOLDER:
                self._queue.add(parent)
            elif store.lock_ref[parent] == 0:
                self._detach(parent)
        return num_pages

    def pinned_pages(self) -> PinnedPages:
        """Pages of pinned nodes, indexed or orphaned. O(tree size): checks only."""
        store = self._nodes
        indexed: set[int] = set()
        orphaned: set[int] = set()
        for top in [*store.children(ROOT), *self._orphans]:
            for node in store.subtree(top):
                pages = store.pages(node)
                if store.lock_ref[node] and pages is not None:
                    (orphaned if store.orphaned[node] else indexed).update(pages)
        return PinnedPages(frozenset(indexed), frozenset(orphaned))

    # --- walks (an L3 attached at run time backs up what L2 holds) -------

    def hot_nodes(self) -> list[NodeRef]:
        """Host-backed nodes, hottest first: by the latest use of the node or
        of anything below it (a prefix is as hot as its hottest extension),
        shallower first on ties, so a chain's prefix precedes its extensions.
        A snapshot, O(n log n); ``node_chain`` says what each still holds."""
        store = self._nodes
        last, serial = store.last_access_time, store.serial
        visited: list[tuple[int, int]] = []
        stack = [(child, 1) for child in store.children(ROOT)]
        while stack:
            node, depth = stack.pop()
            visited.append((node, depth))
            stack.extend((child, depth + 1) for child in store.children(node))
        heat: dict[int, float] = {}
        for node, _ in reversed(visited):  # every child before its parent
            heat[node] = max([last[node], *(heat[c] for c in store.children(node))])
        ranked = sorted((item for item in visited if store.is_host(item[0])),
                        key=lambda item: (-heat[item[0]], item[1], serial[item[0]]))
        return [NodeRef(node, serial[node]) for node, _ in ranked]

    def node_chain(self, ref: NodeRef) -> tuple[list[bytes], list[int | None]] | None:
        """The hashes of blocks 0 .. ``ref``'s last block, and the page of
        each (None: placeholder); None if the node has left the index
        (evicted, invalidated, cleared) since it was handed out."""
        store = self._nodes
        node = ref.node
        if not store.is_live(node) or store.serial[node] != ref.serial:
            return None
        path: list[int] = []
        while node != ROOT:
            if store.orphaned[node]:
                return None
            path.append(node)
            node = store.parent[node]
        chain: list[bytes] = []
        pages: list[int | None] = []
        for step in reversed(path):
            blocks = store.blocks(step)
            chain.extend(blocks)
            run = store.pages(step)
            pages.extend(run if run is not None else [None] * len(blocks))
        return chain, pages

    def root_view(self) -> NodeView:
        """Read-only view of the root and, through it, every reachable node
        (tests and debugging)."""
        return NodeView(self._nodes, ROOT)

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
        find = self._index.find
        store = self._nodes
        keys, page_of = store.key, store.page
        unused: list[int] = []
        node, i = ROOT, 0
        while i < num_blocks:
            child = find(node, hashes[i])
            if child == NO_NODE:
                self._add_chain(node, hashes, pages, i, now, priority)
                return unused  # it offered the leaf it made or grew
            key = keys[child]
            if type(key) is list:
                length = len(key)
                m = _common_len(key, hashes, i, num_blocks)
            else:
                length = m = 1
            placeholder = page_of[child] == PLACEHOLDER
            if placeholder:
                m = _same_kind_run(pages, i, i + m)
            if m < length:
                child = self._split(child, m)
            if not placeholder:
                given = pages[i : i + m]
                # count() runs in C: a long matched prefix with no pages
                # given (the usual store) costs no Python loop.
                if given.count(None) != m:
                    unused.extend(p for p in given if p is not None)
                store.hit_count[child] += 1
            elif pages[i] is not None:
                # _same_kind_run: no None in this run.
                self._fill(child, cast("Sequence[int]", pages[i : i + m]), now)
            store.last_access_time[child] = now
            if priority > store.priority[child]:
                store.priority[child] = priority
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
            bad = sorted(p for p in given if p is not None and p not in self._free.allocated)
            raise ValueError(
                f"insert() pages must be distinct and allocated; not allocated: {bad}"
            )

    def _add_chain(
        self,
        parent: int,
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
        store = self._nodes
        stop = len(pages)
        while stop > start and pages[stop - 1] is None:
            stop -= 1
        if stop == start:
            self._queue.offer(parent)  # walked through: its statistics changed
            return
        node, i = parent, start
        if parent != ROOT and store.page[parent] != PLACEHOLDER \
                and store.first_child[parent] == NO_NODE and pages[start] is not None:
            i += self._extend_leaf(parent, hashes, pages, start, stop)
            if i == stop:
                self._queue.offer(parent)  # still a leaf, with new pages and statistics
                return
        self._queue.discard(parent)
        while i < stop:
            m = _same_kind_run(pages, i, stop)
            run = None
            if pages[i] is not None:
                # _same_kind_run: no None in this run.
                run = page_run(cast("Sequence[int]", pages[i : i + m]))
                self._free.claim(run)
                self._num_cached_pages += m
            child = store.new(node, list(hashes[i : i + m]), run, now, priority)
            self._link(node, child)
            node, i = child, i + m
        self._queue.add(node)

    def _extend_leaf(self, leaf: int, hashes: Sequence[bytes],
                     pages: Sequence[int | None], start: int, stop: int) -> int:
        """Append the host-backed run at ``start`` to ``leaf``; return its length.

        A pin on the leaf covers the new pages too (pins hold whole nodes).
        """
        store = self._nodes
        m = _same_kind_run(pages, start, stop)
        # _same_kind_run from a page (the caller checked): no None in this run.
        run = list(cast("Sequence[int]", pages[start : start + m]))
        self._free.claim(run)
        if store.page[leaf] == IN_RUN:  # already a run: grow it in place
            key = store.key[leaf]
            assert isinstance(key, list), leaf  # a run of blocks is keyed by a list
            key.extend(hashes[start : start + m])
            store.runs[leaf].extend(run)
        else:
            key = [store.first_hash(leaf), *hashes[start : start + m]]
            store.set_run(leaf, key, page_run([store.page[leaf], *run]))
        self._num_cached_pages += m
        if store.lock_ref[leaf]:
            self._num_locked_pages += m
        return m

    def _split(self, node: int, num_blocks: int) -> int:
        """Cut the first ``num_blocks`` blocks of ``node`` off into a new
        parent; return it.

        ``node`` keeps the tail, so a LockHandle pointing at it still reaches
        the new head when it walks up. The head copies every stat, lock_ref
        included: each lock through ``node`` also covered the head.
        """
        store = self._nodes
        key, pages = store.blocks(node), store.pages(node)
        assert 0 < num_blocks < len(key), (num_blocks, len(key))
        parent = store.parent[node]
        self._unlink(node)
        head = store.new(parent, key[:num_blocks],
                         None if pages is None else pages[:num_blocks],
                         store.creation_time[node], store.priority[node])
        store.lock_ref[head] = store.lock_ref[node]
        store.hit_count[head] = store.hit_count[node]
        store.last_access_time[head] = store.last_access_time[node]
        self._link(parent, head)
        store.set_run(node, key[num_blocks:], None if pages is None else pages[num_blocks:])
        store.parent[node] = head
        self._link(head, node)
        return head

    # --- links ------------------------------------------------------------

    def _link(self, parent: int, child: int) -> None:
        """Make ``child`` (whose parent is already ``parent``) reachable."""
        self._nodes.link(parent, child)
        self._index.add(child)

    def _unlink(self, child: int) -> None:
        """Make a reachable ``child`` unreachable; its parent link stays."""
        self._index.remove(child)
        self._nodes.unlink(child)

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

    def _fill(self, node: int, pages: Sequence[int], now: float) -> None:
        """A placeholder's blocks got pages: it becomes host-backed."""
        store = self._nodes
        run = page_run(pages)
        store.set_run(node, store.blocks(node), run)
        self._free.claim(run)
        self._num_cached_pages += len(run)
        if store.lock_ref[node]:
            self._num_locked_pages += len(run)
        store.creation_time[node] = now
        if store.first_child[node] == NO_NODE:  # a locked placeholder whose children were evicted
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
        store = self._nodes
        freed = 0
        hashes: list[bytes] = []
        while freed < num_pages:
            node = self._queue.pop()
            if node is None:
                break
            need = num_pages - freed
            if store.page[node] == IN_RUN and len(store.runs[node]) > need:
                freed += self._trim_tail(node, need, hashes)
                self._queue.offer(node)  # still a leaf, same key
                break
            freed += self._drop_pages(node, hashes)
            self._detach(node)  # an exposed parent is offered there
        if hashes and self._on_evict is not None:
            self._on_evict(hashes)
        return freed

    def _trim_tail(self, node: int, num_blocks: int, hashes: list[bytes]) -> int:
        store = self._nodes
        key, pages = store.blocks(node), store.pages(node)
        assert pages is not None and 0 < num_blocks < len(pages), store.describe(node)
        self._free.push(pages[-num_blocks:])
        hashes.extend(key[-num_blocks:])
        del pages[-num_blocks:]
        del key[-num_blocks:]
        if len(key) == 1:  # back to the one-block form
            store.set_run(node, key, pages)
        self._num_cached_pages -= num_blocks
        return num_blocks

    def _drop_pages(self, node: int, hashes: list[bytes]) -> int:
        """Free a whole host-backed leaf's pages (the node is then detached)."""
        store = self._nodes
        pages = store.pages(node)
        assert pages is not None and store.first_child[node] == NO_NODE \
            and store.lock_ref[node] == 0, store.describe(node)
        self._queue.discard(node)
        self._free.push(pages)
        hashes.extend(store.blocks(node))
        self._num_cached_pages -= len(pages)
        return len(pages)

    def _detach(self, node: int) -> int:
        """Unlink and release a childless node, pruning placeholders that
        become childless. Returns the host-backed ancestor that became a
        leaf, if any (else NO_NODE)."""
        store = self._nodes
        while True:
            parent = store.parent[node]
            assert store.first_child[node] == NO_NODE, store.describe(node)
            self._unlink(node)
            store.release(node)  # not queued: evict discarded it, others are placeholders
            if parent == ROOT or store.first_child[parent] != NO_NODE:
                return NO_NODE
            if store.page[parent] != PLACEHOLDER:
                self._queue.add(parent)
                return parent
            if store.lock_ref[parent]:  # pruned later, by unlock
                return NO_NODE
            node = parent

    def clear(self) -> list[bytes]:
        """Drop every unlocked node (reset_cache); locked paths (and pinned
        orphans) stay. Returns the hashes of the blocks whose pages left."""
        store = self._nodes
        freed: list[int] = []
        hashes: list[bytes] = []
        stack = [ROOT]
        while stack:
            node = stack.pop()
            for child in store.children(node):
                if store.lock_ref[child]:
                    stack.append(child)
                else:
                    self._unlink(child)
                    self._drop_subtree(child, freed, hashes)
            if node != ROOT and store.first_child[node] == NO_NODE \
                    and store.page[node] != PLACEHOLDER:
                self._queue.add(node)
        self._free.push(freed)
        self._num_cached_pages -= len(freed)
        self._queue.rebuild()
        return hashes

    def _orphan(self, top: int, subtree: list[int]) -> None:
        """Cut ``top``'s subtree (``top`` first) out of the index; ``top`` is
        already unlinked.

        Unpinned, its pages are freed at once; pinned, they stay with their
        pins and are freed by the unlock that releases the last one.
        """
        store = self._nodes
        for node in subtree:
            if node != top:
                self._index.remove(node)
            store.orphaned[node] = 1
            self._queue.discard(node)
        if store.lock_ref[top] == 0:
            self._free_orphan(top)
        else:
            self._orphans.add(top)

    def _free_orphan(self, top: int) -> None:
        freed: list[int] = []
        hashes: list[bytes] = []
        self._drop_subtree(top, freed, hashes)
        self._orphans.discard(top)
        self._free.push(freed)
        self._num_cached_pages -= len(freed)
        if hashes and self._on_evict is not None:
            self._on_evict(hashes)

    def _drop_subtree(self, top: int, freed: list[int], hashes: list[bytes]) -> None:
        """Release ``top`` (already unlinked) and every node below it,
        collecting their pages and the hashes of their host-backed blocks."""
        store = self._nodes
        for node in store.subtree(top):
            pages = store.pages(node)
            if pages is not None:
                freed.extend(pages)
                hashes.extend(store.blocks(node))
            if node != top and not store.orphaned[node]:
                self._index.remove(node)
            self._queue.discard(node)
            store.release(node)

    # --- checks ---------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError, with the numbers, if any invariant is broken."""
        check_index(
            self._nodes,
            self._index,
            self._queue,
            self._free,
            self._orphans,
            num_pages=self._num_pages,
            num_cached_pages=self._num_cached_pages,
            num_locked_pages=self._num_locked_pages,
        )
