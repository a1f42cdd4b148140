"""Scheduler half: owns the HiRadixTree and every L2 decision.

Runs in EngineCore. It never touches KV bytes and never waits on I/O; it
emits per-step operations (``HiCacheMetadata``) that the workers execute.

Page lifetime (ranges in blocks of one request)::

    [0, local)            vLLM's own prefix-cache hit (L1)
    [local, local+n)      L2 hit: pages locked by update_state_after_alloc,
                          loaded this step (layerwise) or between steps (async)
    [stored, done)        computed by this step: pages allocated and inserted
                          now, copied by the workers after the forward

Tree mutations that can evict (alloc) happen only in build_connector_meta and
reset_cache, never between a lookup and its update_state_after_alloc, so a
page reported as a hit is still there when it is locked. A sync load's lock
is released at the next build_connector_meta: the workers finish step N's
loads before step N+1's stores can reuse the page.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from vllm_hicache.config import HiCacheConfig
from vllm_hicache.connector.geometry import KVGeometry, host_num_pages
from vllm_hicache.connector.inflight import InflightLoads
from vllm_hicache.connector.request_state import ReqState, track_scheduled
from vllm_hicache.connector.l3_scheduler import StoragePlanner, StoredChain
from vllm_hicache.connector.metadata import BlockCopy, HiCacheMetadata, LoadJob, merge_copies
from vllm_hicache.connector.stats import HiCacheStats
from vllm_hicache.connector.write_back import WriteBackWatcher
from vllm_hicache.host.memory import check_fits
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import loadable_block_limit
from vllm_hicache.policy import make_eviction_policy
from vllm_hicache.policy.write import WritePolicy

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_RECENT_HITS = 4096


class HiCacheScheduler:
    def __init__(self, cfg: HiCacheConfig, geom: KVGeometry, local_ranks: int = 1) -> None:
        self.cfg = cfg
        self.block_size = geom.block_size
        self.num_pages = host_num_pages(cfg, geom)
        # Every rank on this host allocates its own pool: refuse before the
        # tree (or any worker) allocates anything.
        check_fits(self.num_pages * geom.bytes_per_block * local_ranks)
        self.tree = HiRadixTree(
            self.num_pages,
            make_eviction_policy(cfg.radix_eviction_policy),
            on_evict=self._on_l2_evict,
        )
        self.write_policy = WritePolicy(cfg.hicache_write_policy, 4 * self.num_pages)
        self.load_async = cfg.hicache_load_mode == "async"
        self.stats = HiCacheStats()
        # Tokens loaded from L2 for recent requests (bounded), for reports.
        self.recent_hit_tokens: OrderedDict[str, int] = OrderedDict()
        self._reqs: dict[str, ReqState] = {}
        self._local_hit_tokens: dict[str, int] = {}
        self._step_loads: list[LoadJob] = []
        self._step_async_loads: list[LoadJob] = []
        self._step_locks: list[object] = []
        self._prev_step_locks: list[object] = []
        self._inflight = InflightLoads()
        self._write_back: WriteBackWatcher | None = None
        self._evict_pairs: list[tuple[int, int, list[bytes]]] = []
        # L3 tier (set by the connector when a storage backend is configured).
        self.l3: StoragePlanner | None = None
        self._block_pool = None
        self._stored_chains: list[StoredChain] = []
        logger.info(
            "HiCache L2: %d pages x %d bytes = %.2f GB (L1 %d blocks), %s",
            self.num_pages, geom.bytes_per_block,
            self.num_pages * geom.bytes_per_block / 1e9, geom.num_l1_blocks, cfg,
        )

    # --- lookup and load -------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.l3 is not None and self.l3.must_wait(request.request_id):
            return None, False  # per the prefetch policy: ask again later
        pages = self._hit_pages(request, num_computed_tokens)
        if not pages:
            return 0, False
        start = num_computed_tokens // self.block_size
        if self._inflight.overlaps(request.block_hashes[start : start + len(pages)]):
            return None, False  # ask again once that load has landed
        self._local_hit_tokens[request.request_id] = num_computed_tokens
        return len(pages) * self.block_size, self.load_async

    def _hit_pages(self, request: Request, num_computed_tokens: int) -> list[int]:
        start = num_computed_tokens // self.block_size
        limit = loadable_block_limit(request.num_tokens, self.block_size)
        if limit <= start:
            return []
        return self.tree.match(request.block_hashes[:limit]).host_run(start)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        req_id = request.request_id
        local = self._local_hit_tokens.pop(req_id)
        start, num_blocks = local // self.block_size, num_external_tokens // self.block_size
        pages = self._hit_pages(request, local)[:num_blocks]
        # No eviction can run between the lookup and here (see module doc).
        assert len(pages) == num_blocks, (req_id, len(pages), num_blocks)
        end = start + num_blocks
        hashes = request.block_hashes[:end]
        lock = self.tree.lock(hashes, end)
        self.tree.touch(hashes, end, priority=-request.priority)
        block_ids = blocks.get_block_ids()[0][start:end]
        job = LoadJob(req_id, BlockCopy(tuple(block_ids), tuple(pages)))
        if self.load_async:
            self._step_async_loads.append(job)
            self._inflight.start(req_id, lock, hashes[start:])
        else:
            self._step_loads.append(job)
            self._step_locks.append(lock)
        self.stats.record_load(num_blocks)
        self.recent_hit_tokens[req_id] = num_external_tokens
        if len(self.recent_hit_tokens) > _RECENT_HITS:
            self.recent_hit_tokens.popitem(last=False)

    # --- per step --------------------------------------------------------

    def build_connector_meta(self, so: SchedulerOutput) -> HiCacheMetadata:
        for lock in self._prev_step_locks:
            self.tree.unlock(lock)
        self._prev_step_locks, self._step_locks = self._step_locks, []
        track_scheduled(self._reqs, so)
        self._plan_write_backs()
        evict, self._evict_pairs = self._evict_pairs, []
        store_pairs = self._advance_requests(so)
        meta = HiCacheMetadata(
            evict_stores=merge_copies([(block, page) for block, page, _ in evict]),
            loads=self._step_loads,
            async_loads=self._step_async_loads,
            stores=merge_copies(store_pairs),
        )
        self._step_loads, self._step_async_loads = [], []
        self.stats.record_store(len(evict) + len(store_pairs))
        if self.l3 is not None:
            chains = self._stored_chains + [(tuple(c), [len(c) - 1], [p]) for _, p, c in evict]
            meta.backups = self.l3.plan_backup(self.tree, chains)
            meta.prefetches = self.l3.plan_prefetches(self.tree, self._alloc_protecting)
        self._stored_chains = []
        return meta

    def _completed_blocks(self, state: ReqState, num_scheduled: int) -> int:
        """Full blocks whose KV exists once this step's forward has run."""
        done_tokens = state.num_computed_tokens + num_scheduled
        return min(
            len(state.request.block_hashes),
            done_tokens // self.block_size,
            len(state.block_ids),
        )

    def _advance_requests(self, so: SchedulerOutput) -> list[tuple[int, int]]:
        """Store (or, under write-back, just remember) newly computed blocks."""
        pairs: list[tuple[int, int]] = []
        for req_id, num_scheduled in so.num_scheduled_tokens.items():
            state = self._reqs.get(req_id)
            if state is None:
                continue
            lo, hi = state.num_planned, self._completed_blocks(state, num_scheduled)
            if hi <= lo:
                continue
            if self._write_back is not None:
                self._write_back.observe(state.request.block_hashes, lo, hi)
            elif self.write_policy.stores_on_compute:
                pairs += self._store_range(state, lo, hi)
            state.num_planned = hi
        return pairs

    def _store_range(self, state: ReqState, lo: int, hi: int) -> list[tuple[int, int]]:
        hashes = state.request.block_hashes[:hi]
        self.write_policy.record_use(hashes[lo:hi])
        matched = self.tree.match(hashes).pages
        want = [
            i for i in range(lo, hi)
            if (i >= len(matched) or matched[i] is None)
            and self.write_policy.should_store(hashes[i])
        ]
        if not want:
            return []
        pages = self._alloc_protecting(hashes, len(matched), len(want))
        if pages is None:
            self.stats.record_store_skipped(len(want))
            return []
        new_pages: list[int | None] = [None] * (want[-1] + 1)
        for i, page in zip(want, pages):
            new_pages[i] = page
        unused = self.tree.insert(hashes[: want[-1] + 1], new_pages, -state.request.priority)
        assert not unused, unused  # match() said these blocks had no page
        if self.l3 is not None:
            self._stored_chains.append((tuple(hashes[: want[-1] + 1]), want, pages))
        return [(state.block_ids[i], page) for i, page in zip(want, pages)]

    def _alloc_protecting(self, hashes, num_matched: int, num_pages: int) -> list[int] | None:
        """Allocate pages without evicting the chain we are extending."""
        lock = self.tree.lock(hashes, num_matched) if num_matched else None
        try:
            return self.tree.alloc(num_pages)
        finally:
            if lock is not None:
                self.tree.unlock(lock)

    # --- completions, lifecycle ------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            lock = self._inflight.finish(req_id)
            if lock is not None:
                self.tree.unlock(lock)
        meta = output.kv_connector_worker_meta
        if self.l3 is not None and meta is not None:
            self.l3.on_worker_meta(meta, self.tree)
        if output.invalid_block_ids:
            self.stats.record_load_errors(len(output.invalid_block_ids))

    def on_new_request(self, request: Request) -> None:
        self._reqs[request.request_id] = ReqState(request)
        if self.l3 is not None:
            limit = loadable_block_limit(request.num_tokens, self.block_size)
            chain = tuple(request.block_hashes[:limit])
            self.l3.start_lookup(request.request_id, chain, self._resident_blocks(chain))

    def _resident_blocks(self, chain: tuple[bytes, ...]) -> int:
        """Leading blocks already in L2 or in vLLM's own cache (L1)."""
        pages = self.tree.match(chain).pages
        cached = self._block_pool.get_cached_block if self._block_pool is not None else None
        i = 0
        while i < len(chain) and (
            (i < len(pages) and pages[i] is not None)
            or (cached is not None and cached(chain[i], [0]) is not None)
        ):
            i += 1
        return i

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        # An in-flight async load keeps its lock until the worker reports it:
        # vLLM itself delays freeing the blocks of such a request.
        self._reqs.pop(request.request_id, None)
        self._local_hit_tokens.pop(request.request_id, None)
        if self.l3 is not None:
            self.l3.forget(request.request_id)
        return False, None

    def bind_gpu_block_pool(self, block_pool) -> None:
        self._block_pool = block_pool
        if self.cfg.hicache_write_policy == "write_back":
            self._write_back = WriteBackWatcher(
                block_pool, 2 * block_pool.num_gpu_blocks, on_reset=self._plan_write_backs
            )

    def _plan_write_backs(self) -> None:
        if self._write_back is not None:
            self._evict_pairs += self._write_back.plan(self.tree, self._alloc_protecting)

    def _on_l2_evict(self, hashes: list[bytes]) -> None:
        self.stats.record_evict(len(hashes))
        if self._write_back is not None:
            self._write_back.forget(hashes)

    def shutdown(self) -> None:
        if self.l3 is not None:
            self.l3.close()

    def reset_cache(self) -> bool:
        """Drop L2 (``reset_prefix_cache(reset_connector=True)``)."""
        # vLLM resets its own prefix cache first; write-backs that reset just
        # planned would land in pages we are about to free.
        self._evict_pairs.clear()
        self.tree.clear()
        self.write_policy.clear()
        if self._write_back is not None:
            self._write_back.clear_l2()
        return True
