"""The L3 prefetches in flight: one record per read the workers were sent,
from its start until every rank has said it finished.

An op (``PrefetchOp``) reads blocks ``[start, start + len(pages))`` of a
chain from L3 into L2 ``pages`` the planner allocated for it. Until the op
commits them those pages are allocated but in no tree node, so nothing can
evict or reuse them (the scheduler's integrity check expects exactly these
pages outside the tree: ``uncommitted_pages``); the op takes no PageOps pin.

Who calls, and when (the scheduler's thread only):

- the planner (l3/planner.py), which decides what a lookup leads to,
  calls ``start`` with the pages it allocated for the range it chose (in
  ``build_connector_meta``, or in ``must_wait`` for a same-step read), or
  ``probe`` for a declined hit the load gate wants measured; both give
  the PrefetchJob the step's metadata carries, under an op id of this
  backend generation (``set_generation``);
- ``on_worker_meta`` with each step's worker reports: progress only grows,
  and once every rank has reported, the pages all of them verified are
  inserted into the tree (L2 hits from then on: ``BlockStored`` for L2,
  their state flags where the model has a state group); when every rank
  has finished, the pages left over are freed (``BlockRemoved`` for L3:
  found by the lookup, then missing or invalid) and the record is gone;
- ``hold`` keeps a same-step op's job (l3/same_step.py: a request may be
  admitted with its pages in the step the read is sent) until the step's
  metadata takes it (``take_unsent``), or a replace drops it unsent
  (``abort_unsent``: its pages freed).

Invariant: ``inflight_pages`` is the sum of the open ops' pages (at most
``max_inflight_pages``: an op starts only within ``room_pages``); an op's
first ``committed`` pages were handed to the tree (inserted, or freed where
it already had the block), the rest it holds outside it. A request's lookup
record (l3/lookups.py) points at its op (``op``) and is marked ``done`` as
the op ends. No torch, no vLLM.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from vllm_hicache.common.events import MEDIUM_L2, MEDIUM_L3, EventLog
from vllm_hicache.common.jobs import PrefetchJob, PrefetchProgress
from vllm_hicache.common.page_states import PageStates
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.hit_stages import HitTimes, wait_stages
from vllm_hicache.l3.lookups import L3Lookup, L3Lookups
from vllm_hicache.l3.removals import RemovedKeys

# Blocks a probe (a prefetch nobody waits for, to measure L3) reads, at most.
PROBE_BLOCKS = 64
# Prefetch op ids of backend generation g start at g << this (set_generation):
# a late report of a replaced backend's op never names an op of its successor.
GENERATION_SHIFT = 40

# Allocates ``num`` L2 pages for blocks [matched, matched + num) of a chain,
# never evicting a pinned page; None when every page is pinned.
Alloc = Callable[[Sequence[bytes], int, int], "list[int] | None"]


def allocator(alloc: Alloc | None) -> Alloc:
    """The context's allocator, where a prefetch needs pages."""
    if alloc is None:
        raise RuntimeError("the L3 planner's context has no page allocator: it cannot prefetch")
    return alloc


@dataclass(slots=True)
class PrefetchOp:
    op_id: int
    chain: tuple[bytes, ...]   # hashes of blocks 0 .. start + len(pages)
    start: int                 # first block the op fills
    pages: list[int]
    committed: int = 0
    progress: dict[int, PrefetchProgress] = field(default_factory=dict)
    # Its lookup's points in time (hit_stages.py); None for a probe.
    times: HitTimes | None = None
    # A request waits for it (l3/report_wait.py): until must_wait lets it go.
    waited: bool = False
    # Started in this schedule pass for same-step admission (l3/same_step.py),
    # its job not yet planned; and how many of its pages a request admitted
    # in that step loads.
    unsent: bool = False
    same_step: int = 0


class PrefetchOps:
    """One planner's open prefetch ops, by op id, and their counters."""

    def __init__(self, lookups: L3Lookups, removals: RemovedKeys, store_name: str,
                 world_size: int, max_inflight_pages: int,
                 page_states: PageStates | None = None) -> None:
        self.lookups = lookups
        self.removals = removals
        # The L3 medium's name in BlockRemoved (the backend's).
        self.store_name = store_name
        self.world_size = world_size
        self.max_inflight_pages = max_inflight_pages
        # The scheduler half's page flags (models with a state group), set
        # as prefetched pages are indexed.
        self.page_states = page_states
        self._ops: dict[int, PrefetchOp] = {}
        self.inflight_pages = 0
        self._op_ids = itertools.count()
        # Ops started in this schedule pass for same-step admission
        # (l3/same_step.py), their jobs held for this step's metadata.
        self._unsent: list[tuple[PrefetchOp, PrefetchJob]] = []
        # The backend generation the jobs belong to (jobs.py).
        self.generation = 0
        # For metrics (the planner's prefetch_started, prefetched_blocks,
        # prefetch_incomplete).
        self.started = 0
        self.prefetched_blocks = 0
        self.incomplete = 0

    def set_generation(self, generation: int) -> None:
        """Tag the jobs and op ids with ``generation``; before any op starts."""
        self.generation = generation
        self._op_ids = itertools.count(generation << GENERATION_SHIFT)

    @property
    def room_pages(self) -> int:
        """Pages a new op may still take under the in-flight cap."""
        return self.max_inflight_pages - self.inflight_pages

    def num_open(self) -> int:
        return len(self._ops)

    def __iter__(self) -> Iterator[PrefetchOp]:
        return iter(self._ops.values())

    def uncommitted_pages(self) -> set[int]:
        """Pages open prefetches hold outside the tree (not yet committed)."""
        return {p for op in self._ops.values() for p in op.pages[op.committed:]}

    # --- start -----------------------------------------------------------------

    def start(self, lookup: L3Lookup, start: int, pages: list[int],
              waited: bool) -> PrefetchJob:
        """Read blocks [start, start + len(pages)) of the lookup's chain into
        ``pages`` (allocated within ``room_pages``); the op becomes the
        lookup's."""
        num = len(pages)
        op = PrefetchOp(next(self._op_ids), lookup.chain[: start + num], start, pages,
                        times=lookup.times, waited=waited)
        lookup.times.planned = time.monotonic()
        self._ops[op.op_id] = op
        self.started += 1
        self.inflight_pages += num
        self.removals.note(op.chain[start:])
        lookup.op, lookup.done = op, False
        return PrefetchJob(op.op_id, op.chain[start:], tuple(pages), self.generation)

    def probe(self, lookup: L3Lookup, hit: int, tree: HiRadixTree,
              alloc: Alloc | None) -> list[PrefetchJob]:
        """Read (part of) a declined hit nobody waits for, blocks already in
        L2 included, to measure L3 again: the only way a tier whose hits are
        all declined can show it got faster. Pages of blocks L2 already has
        are freed as the prefetch commits (``_advance``)."""
        num = min(hit, PROBE_BLOCKS, self.room_pages)
        if num <= 0:
            return []
        chain = lookup.chain[: lookup.start + num]
        pages = allocator(alloc)(chain, len(tree.match(chain).pages), num)
        if pages is None:
            return []
        op = PrefetchOp(next(self._op_ids), chain, lookup.start, pages)
        self._ops[op.op_id] = op
        self.started += 1
        self.inflight_pages += num
        return [PrefetchJob(op.op_id, chain[lookup.start :], tuple(pages), self.generation)]

    def hold(self, op: PrefetchOp, job: PrefetchJob) -> None:
        """Keep a same-step op's job for this step's metadata (take_unsent):
        until then a request may be admitted with its pages."""
        op.unsent = True
        self._unsent.append((op, job))

    def take_unsent(self) -> list[PrefetchJob]:
        """The held jobs, for this step's metadata: the pass ends."""
        jobs = [job for _, job in self._unsent]
        for op, _ in self._unsent:
            op.unsent = False
        self._unsent = []
        return jobs

    def abort_unsent(self, tree: HiRadixTree | None) -> None:
        """Drop the held ops, never to be sent (a replace or detach): their
        pages go back to ``tree``; a load waiting on one finds no read."""
        for op, _ in self._unsent:
            self._ops.pop(op.op_id, None)
            self.inflight_pages -= len(op.pages)
            if tree is not None:
                tree.free(op.pages)
        self._unsent = []

    # --- completions -------------------------------------------------------------

    def on_worker_meta(self, meta: HiCacheWorkerMetadata, tree: HiRadixTree,
                       events: EventLog | None) -> None:
        """The prefetch part of a step's worker reports: timings, then progress."""
        for op_id, timing_by_rank in meta.prefetch_timing.items():
            op = self._ops.get(op_id)
            if op is not None and op.times is not None:
                for timing in timing_by_rank.values():
                    op.times.add_timing(timing)
        for op_id, by_rank in meta.prefetch.items():
            op = self._ops.get(op_id)
            if op is not None:
                for rank, p in by_rank.items():
                    # Never backwards: a rank's count, end and states only grow.
                    prev = op.progress.get(rank, PrefetchProgress(0, False))
                    op.progress[rank] = PrefetchProgress(
                        max(p.done, prev.done), p.finished or prev.finished,
                        p.state_pages | prev.state_pages)
                self._advance(op, tree, events)

    def _advance(self, op: PrefetchOp, tree: HiRadixTree, events: EventLog | None = None) -> None:
        if len(op.progress) < self.world_size:
            return
        finished = all(p.finished for p in op.progress.values())
        if finished and op.times is not None:
            op.times.seen = time.monotonic()
        done = min(p.done for p in op.progress.values())
        if done > op.committed:
            if self.page_states is not None:
                # Valid only where every rank's object said so.
                valid = frozenset.intersection(*(p.state_pages for p in op.progress.values()))
                self.page_states.mark(op.pages[op.committed : done],
                                      [i in valid for i in range(op.committed, done)])
            new = [None] * (op.start + op.committed) + op.pages[op.committed : done]
            chain = op.chain[: op.start + done]
            unused = tree.insert(chain, new)
            if unused:
                tree.free(unused)  # the tree got those blocks another way
            if events is not None and events.enabled:
                events.stored(MEDIUM_L2, chain, _placed(tree, chain, new, op.start + op.committed,
                                                        bool(unused)))
            self.prefetched_blocks += done - op.committed
            op.committed = done
        if finished:
            if op.times is not None:
                op.times.committed = time.monotonic()
            leftover = op.pages[op.committed :]
            if leftover:
                tree.free(leftover)
                self.incomplete += 1
                if events is not None:
                    # Found by the lookup, then missing or invalid: not
                    # reachable by prefix from here.
                    events.removed(MEDIUM_L3, op.chain[op.start + op.committed :],
                                   self.store_name)
            self.inflight_pages -= len(op.pages)
            del self._ops[op.op_id]
            for lookup in self.lookups:
                if lookup.op is op:
                    lookup.done = True

    # --- per request ---------------------------------------------------------------

    def prefetched_range(self, req_id: str) -> tuple[int, int] | None:
        """Blocks [lo, hi) of the request that its own prefetch put into L2."""
        lookup = self.lookups.get(req_id)
        if lookup is None or lookup.op is None:
            return None
        op = lookup.op  # a same-step load counts its pages before they commit
        return op.start, op.start + max(op.committed, op.same_step)

    def node_range(self, req_id: str) -> tuple[int, int] | None:
        """Blocks [lo, hi) of the request that its own prefetch put into L2
        and its lookup had found in the node tier (a page evicted between
        the two was read from the remote store: still counted here)."""
        fetched = self.prefetched_range(req_id)
        if fetched is None:
            return None
        lookup = self.lookups.get(req_id)
        assert lookup is not None, req_id
        hi = min(fetched[1], lookup.start + lookup.node_found[0])
        return (fetched[0], hi) if hi > fetched[0] else None

    def hit_stages(self, req_id: str, admitted: float) -> dict[str, float] | None:
        """Seconds per stage (hit_stages.WAIT_STAGES) of the wait of a
        request admitted at ``admitted`` with a hit its own prefetch
        brought in; None if it had no prefetch."""
        lookup = self.lookups.get(req_id)
        if lookup is None or lookup.op is None:
            return None
        return wait_stages(lookup.times, admitted)


def _placed(tree: HiRadixTree, chain, new: list, lo: int, some_unused: bool) -> list[int]:
    """Blocks of ``chain[lo:]`` that now hold the pages in ``new`` (all of
    them, unless the tree already had some: then look)."""
    if not some_unused:
        return list(range(lo, len(new)))
    pages = tree.match(chain).pages
    return [i for i in range(lo, len(new)) if i < len(pages) and pages[i] == new[i]]
