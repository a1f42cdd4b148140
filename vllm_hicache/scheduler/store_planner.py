"""L2 store planning: which blocks computed in a step become host pages.

Runs in EngineCore, inside ``build_connector_meta``. Each step it looks only
at the requests whose step completed a block (or recomputes blocks), and for
each of those only at the blocks that are new since its last plan:
``ReqState.num_planned`` is how far a request has been considered, so a long
prompt's chunked prefill costs time proportional to its blocks, not to the
square of them. Blocks vLLM recomputes (a failed load, a preemption) are
considered again, since their pages may have left L2 meanwhile.

Under write-through policies the chosen blocks get pages at once: allocated
without evicting the chain they extend, inserted into the tree and pinned by
a STORE op in the same call, so nothing later in the step can evict a page
a copy still has to fill. When every other page is pinned a store simply
stores fewer blocks (the leading ones). Under write-back the blocks are only
reported to the WriteBackWatcher, which pins pages (``insert_pinned``, op
WRITE_BACK) when vLLM is about to reuse them.

Every range inserted here is also kept for the step's L3 backups
(``take_stored_ranges``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from vllm_hicache.common.events import MEDIUM_L2, EventLog
from vllm_hicache.common.jobs import BlockPage
from vllm_hicache.common.page_ops import OpKind, PageOp, PageOps, PinnedRange
from vllm_hicache.common.page_states import PageStates
from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.index import HiRadixTree
from vllm_hicache.policy.write import WritePolicy
from vllm_hicache.scheduler.group_blocks import GroupBlocks
from vllm_hicache.scheduler.request_state import ReqState
from vllm_hicache.scheduler.write_back import WriteBackWatcher

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_T = TypeVar("_T")


class L2StorePlanner:
    """Owned by HiCacheScheduler, which calls ``advance`` once per step from
    ``build_connector_meta`` and the other methods from the same thread. It
    mutates the tree (alloc, insert), the page ops (STORE and WRITE_BACK
    pins), the request records' ``num_planned``, the page state flags and
    the store counters; it reads the records' controls."""

    def __init__(self, tree: HiRadixTree, ops: PageOps, groups: GroupBlocks,
                 write_policy: WritePolicy, stats: HiCacheStats,
                 page_states: PageStates | None, block_size: int, events: EventLog) -> None:
        self.tree = tree
        self.ops = ops
        self.groups = groups
        # Replaced by a runtime attach that changes the policy (admin/storage_control.py).
        self.write_policy = write_policy
        self.stats = stats
        self.page_states = page_states
        self.block_size = block_size
        self.events = events
        # Set once vLLM's block pool is known, under write_back only.
        self.write_back: WriteBackWatcher | None = None
        self._stored_ranges: list[PinnedRange] = []

    def advance(self, reqs: dict[str, ReqState], scheduler_output: SchedulerOutput,
                step: int) -> list[BlockPage]:
        """Store (or, under write-back, just report) the blocks this step
        completes; the (GPU block, page) copies for the workers."""
        pairs: list[BlockPage] = []
        block_size = self.block_size
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = reqs.get(req_id)
            if state is None:
                continue
            planned_end = state.num_planned * block_size
            computed = state.num_computed_tokens
            if computed >= planned_end and computed + num_scheduled < planned_end + block_size:
                # Most decode steps: no block completed, none recomputed.
                continue
            lo = min(state.num_planned, computed // block_size)
            hi = self._completed_blocks(state, num_scheduled)
            if hi <= lo:
                continue
            store_hi = self._store_limit(state, lo, hi)
            if store_hi <= lo:
                pass
            elif self.write_back is not None:
                self.write_back.observe(state.request.block_hashes, lo, store_hi)
            elif self.write_policy.stores_on_compute:
                pairs += self.store_range(state, lo, store_hi, computed + num_scheduled, step)
            state.num_planned = hi
        return pairs

    def _completed_blocks(self, state: ReqState, num_scheduled: int) -> int:
        """Full blocks whose KV exists once this step's forward has run."""
        done_tokens = state.num_computed_tokens + num_scheduled
        return min(len(state.request.block_hashes), done_tokens // self.block_size,
                   len(state.block_ids))

    def _store_limit(self, state: ReqState, lo: int, hi: int) -> int:
        """End of the blocks [lo, hi) the request's max_offload_tokens lets us store."""
        limit = state.controls.store_block_limit(self.block_size)
        if limit is None or hi <= limit:
            return hi
        self.stats.record_store_limited(hi - max(lo, limit))
        return limit

    def store_range(self, state: ReqState, lo: int, hi: int, done_tokens: int,
                    step: int) -> list[BlockPage]:
        """Pages for the blocks in [lo, hi) that L2 lacks and the write
        policy wants, as many as unpinned pages allow."""
        groups = self.groups
        if groups.sliding_windows:
            # A page is stored whole (every group's KV of its position) or not at all.
            lo = max(lo, groups.first_intact_block(state))
            if lo >= hi:
                return []
        hashes = state.request.block_hashes[:hi]
        self.write_policy.record_use(hashes[lo:hi])
        match = self.tree.match(hashes)
        want = match.missing(lo, hi)
        if groups.hybrid:
            want = [i for i in want if groups.holds_attention(state, i)]
        admitted = self.write_policy.select(hashes, want)
        self.stats.record_store_declined(str(self.write_policy.rule.kind),
                                         len(want) - len(admitted))
        want = admitted
        if not want:
            return []
        pages = self.alloc_up_to_protecting(hashes, match.num_blocks, len(want))
        if len(pages) < len(want):
            # Every other page is pinned: store the leading blocks we can.
            self.stats.record_store_skipped(len(want) - len(pages))
            want = want[: len(pages)]
            if not want:
                return []
        with_state = None
        if self.page_states is not None:
            with_state = [groups.holds_states(state, i, done_tokens) for i in want]
            self.page_states.mark(pages, with_state)
        self.insert_pinned(OpKind.STORE, hashes[: want[-1] + 1], want, pages, step,
                           state.request.priority, state.request)
        self.stats.record_store(len(want))
        return groups.pairs(state.group_block_ids, want, pages, with_state)

    def insert_pinned(self, kind: OpKind, chain: Sequence[bytes], blocks: list[int],
                      pages: list[int],
                      step: int, priority: int = 0, request: Request | None = None) -> PageOp:
        """Index freshly allocated pages and pin them until their copy is
        acknowledged, before anything else in this step can allocate."""
        new_pages: list[int | None] = [None] * len(chain)
        for i, page in zip(blocks, pages):
            new_pages[i] = page
        unused = self.tree.insert(chain, new_pages, -priority)
        assert not unused, unused  # match() said these blocks had no page
        self.events.stored(MEDIUM_L2, chain, blocks, request)
        rng = PinnedRange(tuple(chain), tuple(blocks), tuple(pages))
        self._stored_ranges.append(rng)
        return self.ops.open(kind, step, [rng])

    def alloc_protecting(self, hashes: Sequence[bytes], num_matched: int,
                         num_pages: int) -> list[int] | None:
        """``num_pages`` pages, allocated without evicting the first
        ``num_matched`` blocks of the chain we are extending; None when
        unpinned pages do not suffice."""
        return self._protecting(hashes, num_matched, lambda: self.tree.alloc(num_pages))

    def alloc_up_to_protecting(self, hashes: Sequence[bytes], num_matched: int,
                               num_pages: int) -> list[int]:
        """As alloc_protecting, but as many pages as unpinned pages allow (maybe none)."""
        return self._protecting(hashes, num_matched, lambda: self.tree.alloc_up_to(num_pages))

    def _protecting(self, hashes: Sequence[bytes], num_matched: int,
                    alloc: Callable[[], _T]) -> _T:
        lock = self.tree.lock(hashes, num_matched) if num_matched else None
        try:
            return alloc()
        finally:
            if lock is not None:
                self.tree.unlock(lock)

    def take_stored_ranges(self) -> list[PinnedRange]:
        """The ranges inserted since the last call (the step's L3 backups)."""
        ranges, self._stored_ranges = self._stored_ranges, []
        return ranges
