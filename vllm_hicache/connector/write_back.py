"""Write-back: copy a block to L2 only when vLLM is about to reuse it.

The watcher wraps the engine's BlockPool (``bind_gpu_block_pool``): when
``get_new_blocks`` evicts a cached block, or ``reset_prefix_cache`` drops
all of them, the block's hash and id are recorded. The next
``build_connector_meta`` allocates pages for them and emits ``evict_stores``,
which every worker copies in ``handle_preemptions``, i.e. before the forward
that overwrites the reused block.

The radix tree needs a block's whole chain, but the pool only knows the
block, so the watcher keeps parent links: ``_l1_parent`` for blocks seen in
L1, ``_l2_parent`` for blocks it wrote back (dropped when L2 evicts them).
A block whose chain is unknown is simply not written back (a miss later).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import block_hash_of_group_key

_MISSING = object()


class WriteBackWatcher:
    def __init__(self, block_pool, max_tracked_blocks: int, on_reset=None) -> None:
        if not block_pool.enable_caching:
            raise ValueError(
                "hicache_write_policy=write_back needs vLLM's prefix caching "
                "(enable_prefix_caching=True)"
            )
        self._max_tracked = max_tracked_blocks
        self._evicted: list[tuple[bytes, int]] = []
        self._l1_parent: dict[bytes, bytes | None] = {}
        self._l2_parent: dict[bytes, bytes | None] = {}
        self._in_alloc = False
        # Called after a successful reset_prefix_cache: it runs between steps,
        # so the scheduler may plan (and index) those write-backs at once and
        # the very next step can already hit them.
        self._on_reset = on_reset
        self._wrap(block_pool)

    def _wrap(self, pool) -> None:
        get_new_blocks = pool.get_new_blocks
        maybe_evict = pool._maybe_evict_cached_block
        reset = pool.reset_prefix_cache

        def watched_get_new_blocks(num_blocks: int):
            self._in_alloc = True
            try:
                return get_new_blocks(num_blocks)
            finally:
                self._in_alloc = False

        def watched_maybe_evict(block) -> bool:
            # Only reuse matters: evict_blocks() drops blocks that failed to
            # load, and those must never reach L2.
            if self._in_alloc and block.block_hash is not None:
                self._record(block)
            return maybe_evict(block)

        def watched_reset() -> bool:
            cached = [b for b in pool.blocks if b.block_hash is not None]
            snapshot = [(block_hash_of_group_key(b.block_hash), b.block_id) for b in cached]
            ok = reset()
            if ok:
                self._evicted += snapshot
                if self._on_reset is not None:
                    self._on_reset()
            return ok

        pool.get_new_blocks = watched_get_new_blocks
        pool._maybe_evict_cached_block = watched_maybe_evict
        pool.reset_prefix_cache = watched_reset

    def _record(self, block) -> None:
        self._evicted.append((block_hash_of_group_key(block.block_hash), block.block_id))

    def observe(self, hashes: Sequence[bytes], lo: int, hi: int) -> None:
        """Blocks [lo, hi) of a request's chain are now computed in L1."""
        for i in range(lo, hi):
            self._l1_parent[hashes[i]] = hashes[i - 1] if i else None
        while len(self._l1_parent) > self._max_tracked:
            del self._l1_parent[next(iter(self._l1_parent))]

    def forget(self, hashes: Sequence[bytes]) -> None:
        """L2 evicted these blocks."""
        for h in hashes:
            self._l2_parent.pop(h, None)

    def clear_l2(self) -> None:
        self._l2_parent.clear()

    def plan(self, tree: HiRadixTree, alloc) -> list[tuple[int, int, list[bytes]]]:
        """Pages for this step's evicted blocks: (block id, page, chain)."""
        pairs: list[tuple[int, int, list[bytes]]] = []
        evicted, self._evicted = self._evicted, []
        for block_hash, block_id in evicted:
            parent = self._l1_parent.pop(block_hash, _MISSING)
            chain = None if parent is _MISSING else self._chain(block_hash, parent)
            if chain is None:
                continue
            matched = tree.match(chain).pages
            if len(matched) == len(chain) and matched[-1] is not None:
                self._l2_parent[block_hash] = parent
                continue
            pages = alloc(chain, len(matched), 1)
            if pages is None:
                continue
            tree.insert(chain, [None] * (len(chain) - 1) + pages)
            self._l2_parent[block_hash] = parent
            pairs.append((block_id, pages[0], chain))
        return pairs

    def _chain(self, block_hash: bytes, parent) -> list[bytes] | None:
        chain = [block_hash]
        cur = parent
        while cur is not None:
            nxt = self._l1_parent.get(cur, _MISSING)
            if nxt is _MISSING:
                nxt = self._l2_parent.get(cur, _MISSING)
            if nxt is _MISSING:
                return None
            chain.append(cur)
            cur = nxt
        chain.reverse()
        return chain
