"""Write-back: copy a block to L2 only when vLLM is about to reuse it.

The watcher wraps the engine's BlockPool (``bind_gpu_block_pool``): when
``get_new_blocks`` evicts a cached block, or ``reset_prefix_cache`` drops
all of them, the block's hash and id are recorded. The next
``build_connector_meta`` allocates pages for them and emits ``evict_stores``,
which every worker copies in ``handle_preemptions``, i.e. before the forward
that overwrites the reused block.

The radix tree needs a block's whole chain, but the pool only knows the
block, so the watcher keeps parent links (``_parent``: block hash -> hash of
the block before it, None for block 0). A block with a missing link on its
chain is simply not written back (a miss later). A link is held by:

- the tracked set T (``_order`` + ``_parked``): blocks observed computed in
  L1, not seen evicted since, plus ``_relays``: blocks that left L1 (or L2)
  while a tracked block below them still walks through them; a relay leaves
  T with its last tracked child;
- ``_in_l2``: blocks with an L2 page that this watcher wrote (or found
  there); ``forget`` releases them when the tree evicts them.

Invariants (``check_invariants``):

- ``_parent``'s keys are exactly T | ``_in_l2``, so memory is bounded by
  ``max_tracked_blocks`` + the number of L2 pages;
- ``len(T) <= max_tracked_blocks`` after every public call;
- ``_num_children[h]`` is the number of members of T whose parent is h;
  ``_parked`` and ``_relays`` hold only members with a tracked child.

Trimming drops the least recently observed member of T that has no tracked
child. Dropping such a leaf loses one block's chain, dropping an ancestor
would lose the chains of every tracked block below it, so a parent always
outlives its tracked children. Observing a block again moves it to the end
of ``_order``: a hot shared prefix is never the oldest. A member that reaches
the front of ``_order`` while it still has a tracked child is parked instead
of dropped; when its last tracked child goes, it returns to the front of
``_order``, which is exact LRU: everything left in ``_order`` was observed
after it. T always has a leaf unless the links form a cycle, which chained
hashes cannot; only then is the longest-parked member dropped, the bound
winning over its children's chains. Each observed block costs O(1) amortized:
every park or unpark is paid by an observation or a drop.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from vllm_hicache.common.page_ops import OpKind
from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.connector.vllm_compat import l1_block_id, watch_block_pool
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import block_hash_of_group_key

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

# alloc(chain, num_matched, num_pages) -> pages, or None when L2 is full.
Alloc = Callable[[Sequence[bytes], int, int], "list[int] | None"]
# insert(chain, page): index a new page for the chain's last block.
Insert = Callable[[list[bytes], int], None]

_MISSING = object()


class WriteBackCopy(NamedTuple):
    """One block to copy from L1 to L2 before vLLM overwrites it."""

    block_id: int
    page: int
    # The block's chain, block 0 first; the block itself is last.
    chain: list[bytes]


class WriteBackWatcher:
    def __init__(self, block_pool: BlockPool, max_tracked_blocks: int,
                 on_reset: Callable[[], None] | None = None) -> None:
        if not block_pool.enable_caching:
            raise ValueError(
                "hicache_write_policy=write_back needs vLLM's prefix caching "
                "(enable_prefix_caching=True)"
            )
        if max_tracked_blocks < 0:
            raise ValueError(f"max_tracked_blocks must be >= 0, got {max_tracked_blocks}")
        self._max_tracked = max_tracked_blocks
        self._evicted: list[tuple[bytes, int]] = []
        self._parent: dict[bytes, bytes | None] = {}
        self._num_children: dict[bytes, int] = {}
        # Both oldest first; the values are unused.
        self._order: OrderedDict[bytes, None] = OrderedDict()
        self._parked: OrderedDict[bytes, None] = OrderedDict()
        self._relays: set[bytes] = set()
        self._in_l2: set[bytes] = set()
        # Called after a successful reset_prefix_cache: it runs between steps,
        # so the scheduler may plan (and index) those write-backs at once and
        # the very next step can already hit them.
        self._on_reset = on_reset
        watch_block_pool(block_pool, self._record, self._record_reset)

    def _record_reset(self, cached: list[tuple[bytes, int]]) -> None:
        self._evicted += [(block_hash_of_group_key(key), block_id) for key, block_id in cached]
        if self._on_reset is not None:
            self._on_reset()

    def _record(self, block: KVCacheBlock) -> None:
        self._evicted.append((block_hash_of_group_key(block.block_hash), block.block_id))

    @property
    def num_tracked_blocks(self) -> int:
        """Size of T, the set bounded by ``max_tracked_blocks``."""
        return len(self._order) + len(self._parked)

    @property
    def num_parent_links(self) -> int:
        """Links held: T plus the blocks written to L2 and not yet evicted."""
        return len(self._parent)

    # --- events -----------------------------------------------------------

    def observe(self, hashes: Sequence[bytes], lo: int, hi: int) -> None:
        """Blocks [lo, hi) of a request's chain are now computed in L1."""
        for i in range(lo, hi):
            block_hash = hashes[i]
            self._link(block_hash, hashes[i - 1] if i else None)
            self._touch(block_hash)
        self._trim()

    def forget(self, hashes: Sequence[bytes]) -> None:
        """L2 evicted these blocks."""
        for h in hashes:
            if h not in self._in_l2:
                continue
            self._in_l2.discard(h)
            if self._is_tracked(h):
                continue
            if self._num_children.get(h):
                # A tracked block below still walks through this link. Only
                # reachable when a block was observed after its parent had
                # left T (observe with lo > 0).
                self._track(h)
                self._relays.add(h)
            else:
                del self._parent[h]
        self._trim()

    def clear_l2(self) -> None:
        self.forget(list(self._in_l2))

    def plan(self, tree: HiRadixTree, alloc: Alloc,
             insert: Insert | None = None) -> list[WriteBackCopy]:
        """Pages for the blocks evicted from L1 since the last call.

        ``alloc(chain, num_matched, num_pages)`` returns pages or None;
        ``insert(chain, page)`` indexes a new page for the chain's last block
        (the scheduler also pins it until its copy is acknowledged, so a
        later alloc of this call cannot take it); by default a plain
        ``tree.insert``.
        """
        copies: list[WriteBackCopy] = []
        evicted, self._evicted = self._evicted, []
        for block_hash, block_id in evicted:
            parent = self._parent.get(block_hash, _MISSING)
            if parent is _MISSING:
                continue  # never observed, or trimmed
            chain = self._chain(block_hash)
            in_l2 = chain is not None and self._store(tree, alloc, insert, chain, block_id, copies)
            self._leave_l1(block_hash, parent, in_l2)  # type: ignore[arg-type]
        return copies

    def write_back_tracked(self, l1_block_id: Callable[[bytes], int | None]) -> int:
        """Queue every tracked block still in L1 for the next ``plan``, as if
        vLLM were about to reuse it: a graceful stop (graceful_stop.py) keeps
        what only L1 holds. Shallow blocks first (L3 lookups reach a chain
        from its start), then the most recently observed; ``l1_block_id(h)``
        is the L1 block caching ``h`` now, None if it left L1 (a relay).
        Returns the blocks queued."""
        depth: dict[bytes, int] = {}

        def depth_of(h: bytes) -> int:
            walked: list[bytes] = []
            cur: bytes | None = h
            while cur is not None and cur not in depth and len(walked) <= len(self._parent):
                walked.append(cur)
                cur = self._parent.get(cur)  # a missing link ends the walk
            d = depth.get(cur, 0) if cur is not None else 0
            for w in reversed(walked):
                d += 1
                depth[w] = d
            return depth[h]

        recency = {h: i for i, h in enumerate(self._order)}
        tracked = sorted(self._order.keys() | self._parked.keys(),
                         key=lambda h: (depth_of(h), -recency.get(h, -1)))
        queued = 0
        for block_hash in tracked:
            block_id = l1_block_id(block_hash)
            if block_id is not None:
                self._evicted.append((block_hash, block_id))
                queued += 1
        return queued

    def check_invariants(self) -> None:
        """Raise RuntimeError, with the numbers, if an invariant is broken."""
        tracked = self._order.keys() | self._parked.keys()
        problems = []
        if len(tracked) != self.num_tracked_blocks:
            both = self._order.keys() & self._parked.keys()
            problems.append(f"{len(both)} both in order and parked")
        if len(tracked) > self._max_tracked:
            problems.append(f"{len(tracked)} tracked > bound {self._max_tracked}")
        held = tracked | self._in_l2
        if self._parent.keys() != held:
            problems.append(
                f"{len(self._parent.keys() - held)} links unheld, "
                f"{len(held - self._parent.keys())} held without a link"
            )
        counted = Counter(self._parent.get(h) for h in tracked)
        counted.pop(None, None)
        if counted != self._num_children:
            problems.append(
                f"child counts wrong for {len(set(counted) ^ set(self._num_children))} blocks"
            )
        childless = [h for h in self._parked.keys() | self._relays if h not in self._num_children]
        if childless:
            problems.append(f"{len(childless)} parked or relays without a tracked child")
        if not self._relays <= tracked:
            problems.append(f"{len(self._relays - tracked)} relays not tracked")
        if problems:
            raise RuntimeError("WriteBackWatcher: " + "; ".join(problems))

    # --- write-back -------------------------------------------------------

    def _store(
        self,
        tree: HiRadixTree,
        alloc: Alloc,
        insert: Insert | None,
        chain: list[bytes],
        block_id: int,
        copies: list[WriteBackCopy],
    ) -> bool:
        """Give the chain's last block an L2 page; False if L2 has no room."""
        matched = tree.match(chain).pages
        if len(matched) == len(chain) and matched[-1] is not None:
            return True
        pages = alloc(chain, len(matched), 1)
        if pages is None:
            return False
        if insert is not None:
            insert(chain, pages[0])
        else:
            placeholders: list[int | None] = [None] * (len(chain) - 1)
            unused = tree.insert(chain, [*placeholders, *pages])
            assert not unused, unused  # match() said the block had no page
        copies.append(WriteBackCopy(block_id, pages[0], chain))
        return True

    def _leave_l1(self, block_hash: bytes, parent: bytes | None, in_l2: bool) -> None:
        if in_l2:
            # alloc() may have evicted from L2 and the forget() it triggered
            # trimmed this very link; the new page's children need it.
            self._link(block_hash, parent)
            self._in_l2.add(block_hash)
        if self._is_tracked(block_hash):
            if self._num_children.get(block_hash):
                # vLLM evicted a parent first: the tracked child's chain
                # still passes here.
                self._relays.add(block_hash)
            else:
                self._untrack(block_hash)
        if block_hash in self._parent and not self._is_held(block_hash):
            del self._parent[block_hash]

    def _chain(self, block_hash: bytes) -> list[bytes] | None:
        chain = [block_hash]
        cur = self._parent[block_hash]
        while cur is not None:
            nxt = self._parent.get(cur, _MISSING)
            # Chained hashes cannot loop; the length check only guards
            # against a caller feeding inconsistent chains.
            if nxt is _MISSING or len(chain) > len(self._parent):
                return None
            chain.append(cur)
            cur = nxt  # type: ignore[assignment]
        chain.reverse()
        return chain

    # --- links and the tracked set ----------------------------------------

    def _is_tracked(self, block_hash: bytes) -> bool:
        return block_hash in self._order or block_hash in self._parked

    def _is_held(self, block_hash: bytes) -> bool:
        return self._is_tracked(block_hash) or block_hash in self._in_l2

    def _link(self, block_hash: bytes, parent: bytes | None) -> None:
        old = self._parent.get(block_hash, _MISSING)
        if old is not _MISSING and old == parent:
            return
        tracked = self._is_tracked(block_hash)
        if tracked and old is not _MISSING:
            self._lose_child(old)  # type: ignore[arg-type]
        self._parent[block_hash] = parent
        if tracked:
            self._gain_child(parent)

    def _touch(self, block_hash: bytes) -> None:
        """A linked block was just observed: the newest member of T."""
        self._relays.discard(block_hash)
        if block_hash in self._order:
            self._order.move_to_end(block_hash)
        elif block_hash in self._parked:
            del self._parked[block_hash]
            self._order[block_hash] = None
        else:
            self._track(block_hash)

    def _track(self, block_hash: bytes) -> None:
        self._order[block_hash] = None
        self._gain_child(self._parent[block_hash])

    def _untrack(self, block_hash: bytes) -> None:
        if self._order.pop(block_hash, _MISSING) is _MISSING:
            del self._parked[block_hash]
        self._relays.discard(block_hash)
        self._lose_child(self._parent[block_hash])

    def _gain_child(self, parent: bytes | None) -> None:
        if parent is not None:
            self._num_children[parent] = self._num_children.get(parent, 0) + 1

    def _lose_child(self, parent: bytes | None) -> None:
        while parent is not None:
            num_children = self._num_children[parent] - 1
            if num_children:
                self._num_children[parent] = num_children
                return
            del self._num_children[parent]
            if parent in self._relays:
                # Kept only for the blocks below, now all gone; so may its
                # own parent be. Each step removes a member: O(1) amortized.
                self._relays.discard(parent)
                if self._order.pop(parent, _MISSING) is _MISSING:
                    del self._parked[parent]
                block_hash, parent = parent, self._parent[parent]
                if block_hash not in self._in_l2:
                    del self._parent[block_hash]
                continue
            if parent in self._parked:
                # Parked when it was the oldest in _order; all there is newer.
                del self._parked[parent]
                self._order[parent] = None
                self._order.move_to_end(parent, last=False)
            return

    def _trim(self) -> None:
        while len(self._order) + len(self._parked) > self._max_tracked:
            if self._order:
                block_hash = next(iter(self._order))
                if self._num_children.get(block_hash):
                    del self._order[block_hash]
                    self._parked[block_hash] = None
                    continue
            else:
                block_hash = next(iter(self._parked))  # only a cycle of links
            self._untrack(block_hash)
            if block_hash not in self._in_l2:
                del self._parent[block_hash]


class StoresLike(Protocol):
    """What EvictionWriteBacks uses of the scheduler's L2StorePlanner
    (store_planner.py, which imports this module)."""

    tree: HiRadixTree
    write_back: WriteBackWatcher | None

    def alloc_protecting(self, hashes: Sequence[bytes], num_matched: int,
                         num_pages: int) -> list[int] | None: ...

    def insert_pinned(self, kind: OpKind, chain: Sequence[bytes], blocks: list[int],
                      pages: list[int], step: int) -> object: ...


class EvictionWriteBacks:
    """The scheduler half's side of write-back: the copies L1 evictions ask
    for, from planning to the step that emits them.

    Built by HiCacheScheduler, which calls, all on the engine thread:
    ``watch`` from ``bind_gpu_block_pool`` under ``write_back`` only (it sets
    ``stores.write_back``); ``queue_l1_only`` at a graceful stop's first step,
    then ``plan`` and ``take`` from ``build_connector_meta``; ``forget`` from
    the tree's L2 eviction callback; ``clear_l2`` from ``reset_cache``. The
    watcher calls ``plan`` itself after vLLM's ``reset_prefix_cache``.
    ``plan`` mutates the L2 tree (alloc, insert), the page ops (one pinned
    WRITE_BACK op per copy, released with its step's acks) and the
    skipped-store counter; ``take`` the store counter. With no watcher
    (another policy) each call does nothing.
    """

    def __init__(self, stores: StoresLike, stats: HiCacheStats,
                 current_step: Callable[[], int]) -> None:
        self._stores = stores
        self._stats = stats
        # The step being scheduled: a write-back's pin ends with that step's acks.
        self._current_step = current_step
        self._block_pool: BlockPool | None = None
        # Planned, their pages inserted and pinned, not yet emitted.
        self._copies: list[WriteBackCopy] = []

    def watch(self, block_pool: BlockPool) -> None:
        """Record the blocks vLLM evicts from ``block_pool`` from now on."""
        self._block_pool = block_pool
        self._stores.write_back = WriteBackWatcher(
            block_pool, 2 * block_pool.num_gpu_blocks, on_reset=self.plan)

    def plan(self) -> None:
        """Pages for the blocks evicted from L1 since the last plan; the
        copies wait for ``take``."""
        watcher = self._stores.write_back
        if watcher is not None:
            self._copies += watcher.plan(self._stores.tree, self._alloc, self._insert_pinned)

    def queue_l1_only(self) -> int:
        """A graceful stop with an L3: queue every tracked block still in L1
        for the next ``plan``, so what only L1 holds reaches L2 in this step,
        then L3 (graceful_stop.py). Returns the blocks queued."""
        watcher, pool = self._stores.write_back, self._block_pool
        if watcher is None or pool is None:
            return 0
        return watcher.write_back_tracked(lambda block_hash: l1_block_id(pool, block_hash))

    def take(self) -> list[WriteBackCopy]:
        """The copies planned since the last call (this step's
        ``evict_stores``), counted as stored (``store_range`` counts its own)."""
        copies, self._copies = self._copies, []
        self._stats.record_store(len(copies))
        return copies

    def forget(self, hashes: Sequence[bytes]) -> None:
        """L2 evicted these blocks: their links may go."""
        watcher = self._stores.write_back
        if watcher is not None:
            watcher.forget(hashes)

    def clear_l2(self) -> None:
        """L2 was dropped. The copies already planned stay: their pages are
        pinned until the workers acknowledge them."""
        watcher = self._stores.write_back
        if watcher is not None:
            watcher.clear_l2()

    def _alloc(self, chain: Sequence[bytes], num_matched: int,
               num_pages: int) -> list[int] | None:
        pages = self._stores.alloc_protecting(chain, num_matched, num_pages)
        if pages is None:  # every page pinned: this block is simply not kept
            self._stats.record_store_skipped(num_pages)
        return pages

    def _insert_pinned(self, chain: Sequence[bytes], page: int) -> None:
        # Pinned at once (the op ledger releases it with the step's acks), so
        # a later alloc of the same plan cannot take the page.
        self._stores.insert_pinned(OpKind.WRITE_BACK, chain, [len(chain) - 1], [page],
                                   self._current_step())
