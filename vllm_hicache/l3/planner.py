"""Scheduler half of the L3 tier: lookups, prefetch ops, backup ops.

Lookup: when a request arrives, the blocks beyond what L1/L2 hold are looked
up in L3 (``exists_prefix``, min over TP ranks) on a background thread, so
the scheduler never waits on I/O. Prefetch: in ``build_connector_meta`` a
finished lookup whose hit reaches ``prefetch_threshold`` gets host pages
(bounded by the in-flight cap) and becomes a PrefetchJob for the workers.
As every rank reports progress, the pages all ranks have verified are
inserted into the tree: from then on they are ordinary L2 hits. Backup:
pages stored to L2 in a step are written to L3 by the workers after the
store; a BACKUP op (page_ops.py) pins them until every rank has acknowledged.

Prefetch policies decide only whether a request *waits* for its lookup and
prefetch (``must_wait``): best_effort never, wait_complete until the
prefetch ends (but never past ``prefetch_timeout_max``: a stuck store must not
stall a request), timeout until it ends or its deadline passes. Under
``hicache_load_decision=auto`` a waiting policy waits only for a hit that is
expected to arrive faster than vLLM would compute it (``LoadGate``, judged
when the lookup starts, for the longest possible hit, and again when it
finishes, for the actual one); a declined hit is still prefetched, as under
best_effort, for later requests.

Backups are bounded (policy/offload.py): a step's stored pages are backed
up at once while fewer than ``max_backup_pages`` pages are unacknowledged
(so the bound is overshot by one step's stores at most); otherwise they are
deferred to a bounded backlog (unpinned), flushed most valuable first as
acknowledgements make room, which keeps an idle engine stepping until it is
empty.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from vllm_hicache.common.events import MEDIUM_L2, MEDIUM_L3, EventLog
from vllm_hicache.common.jobs import BackupJob, PrefetchJob, PrefetchProgress
from vllm_hicache.common.page_ops import OpKind, PageOp, PageOps, PinnedRange
from vllm_hicache.common.page_states import PageStates
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.daemon_pool import DaemonPool
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.policy.offload import BackupBacklog, backup_inflight_cap
from vllm_hicache.policy.prefetch import PrefetchPolicy
from vllm_hicache.storage import StorageBackend
from vllm_hicache.storage_config import StorageConfig

logger = logging.getLogger(__name__)

# Lookups queued or running at once, at most (one lookup thread).
MAX_PENDING_LOOKUPS = 256
# Blocks a probe (a prefetch nobody waits for, to measure L3) reads, at most.
PROBE_BLOCKS = 64


class LoadGateLike(Protocol):
    """What the planner asks the scheduler half's LoadGate (scheduler/load_gate.py)."""

    def prefetch_l3(self, start: int, num_tokens: int, num_pages: int) -> bool: ...

    def wants_l3_sample(self) -> bool: ...

    def record(self, tier: str, loaded: bool, num_tokens: int) -> None: ...


# Allocates ``num`` L2 pages for blocks [matched, matched + num) of a chain,
# never evicting a pinned page; None when every page is pinned.
Alloc = Callable[[Sequence[bytes], int, int], "list[int] | None"]


def _allocator(alloc: Alloc | None) -> Alloc:
    """The context's allocator, where a prefetch needs pages."""
    if alloc is None:
        raise RuntimeError("the L3 planner's context has no page allocator: it cannot prefetch")
    return alloc


@dataclass
class PlannerContext:
    """The scheduler half's state the L3 planner acts on: its L2 index and
    page operations, its page allocator, its load gate and its event log.
    Handed over once, at construction; ``events`` follows the scheduler's
    (``HiCacheScheduler.events``)."""

    tree: HiRadixTree
    ops: PageOps
    alloc: Alloc | None = None
    gate: LoadGateLike | None = None
    events: EventLog | None = None


@dataclass(slots=True)
class _Op:
    op_id: int
    chain: tuple[bytes, ...]   # hashes of blocks 0 .. start + len(pages)
    start: int                 # first block the op fills
    pages: list[int]
    committed: int = 0
    progress: dict[int, PrefetchProgress] = field(default_factory=dict)


@dataclass(slots=True)
class _Lookup:
    chain: tuple[bytes, ...]   # hashes of blocks 0 .. limit
    start: int
    deadline: float
    future: Future[int]        # the store's hit count for chain[start:]
    op: _Op | None = None
    done: bool = False         # nothing (more) to wait for
    timed_out: bool = False    # counted as prefetches{event=timed_out}
    nowait: bool = False       # hicache_load_decision declined to wait for it


class L3Planner:
    def __init__(self, cfg: StorageConfig, backend: StorageBackend, namespaces: list[KeyNamespace],
                 block_size: int, world_size: int, max_inflight_pages: int,
                 ctx: PlannerContext | None = None, max_backup_pages: int | None = None,
                 page_states: PageStates | None = None) -> None:
        self.cfg = cfg
        # The scheduler half's state this planner acts on, handed over once;
        # None: a planner that only names keys and looks up (tools, tests).
        self.ctx = ctx
        # The scheduler half's page flags (models with a state group): read
        # for backups, set as prefetched pages are indexed.
        self.page_states = page_states
        self.backend = backend
        self.namespaces = namespaces
        self.block_size = block_size
        self.world_size = world_size
        self.max_inflight_pages = max_inflight_pages
        self.threshold_blocks = max(1, -(-cfg.prefetch_threshold // block_size))
        self.prefetch_policy = PrefetchPolicy(
            cfg.prefetch_policy, cfg.prefetch_timeout_base, cfg.prefetch_timeout_per_ki_token,
            cfg.prefetch_timeout_max)
        self._executor = DaemonPool(1, "hicache-lookup")
        self._lookups: dict[str, _Lookup] = {}
        # Kept by the lookups' completion callbacks (the lookup thread), so a
        # new request or a step costs O(1), not a scan of every lookup.
        self._pending_lock = threading.Lock()
        self._num_pending_lookups = 0
        self._finished_lookups: collections.deque[tuple[str, _Lookup]] = collections.deque()
        self._ops: dict[int, _Op] = {}
        self._inflight_pages = 0
        self._backups: dict[int, PageOp] = {}
        self._backup_acks: dict[int, set[int]] = {}
        self._op_ids = itertools.count()
        self.prefetched_blocks = 0
        self.skipped_lookups = 0
        self.backed_up_blocks = 0
        # For metrics (stats.planner_samples).
        self.prefetch_started = 0
        self.prefetch_revoked = 0
        self.prefetch_incomplete = 0
        self.prefetch_timed_out = 0
        self.lookup_errors = 0
        # Open backup -> hashes some rank failed to write (kv_events.py).
        self._backup_failures: dict[int, set[bytes]] = {}
        # Backpressure (policy/offload.py): pages of open backups, the bound,
        # and the deferred ones.
        self.max_backup_pages = (max_backup_pages if max_backup_pages is not None
                                 else backup_inflight_cap(max_inflight_pages))
        self._backup_pages = 0
        self._bounded: dict[int, int] = {}  # backup op -> its pages counted in _backup_pages
        self.backlog = BackupBacklog(max(1, max_inflight_pages))
        self.backup_deferred = 0
        self.backup_flushed = 0
        self.backup_dropped = 0
        self.backup_evicted = 0

    def _context(self) -> PlannerContext:
        """The scheduler state; planning or completing ops without it is a bug."""
        if self.ctx is None:
            raise RuntimeError("this L3Planner was built without a PlannerContext "
                               "(lookups only): it cannot plan or complete page ops")
        return self.ctx

    # --- lookups -----------------------------------------------------------

    def start_lookup(self, req_id: str, chain: tuple[bytes, ...], start: int) -> None:
        """Look up blocks [start, len(chain)) of a new request in L3. With a
        ``gate`` (LoadGate), under a waiting policy, the request waits only
        if a hit as long as the chain is expected to arrive sooner than
        vLLM would compute it (decided once, here: it must not wait for
        the lookup either)."""
        if len(chain) - start < self.threshold_blocks:
            return
        if self._num_pending_lookups >= MAX_PENDING_LOOKUPS:
            # A slow or dead store must not build an unbounded backlog: the
            # request simply gets no L3 hit.
            self.skipped_lookups += 1
            return
        wait_s = self.prefetch_policy.wait_budget_s((len(chain) - start) * self.block_size)
        deadline = time.monotonic() + wait_s
        nowait = False
        gate = self.ctx.gate if self.ctx is not None else None
        if gate is not None and self.prefetch_policy.ever_waits:
            num = len(chain) - start
            nowait = not gate.prefetch_l3(start * self.block_size, num * self.block_size, num)
        with self._pending_lock:
            self._num_pending_lookups += 1
        future = self._executor.submit(self._exists, chain[start:])
        lookup = _Lookup(chain, start, deadline, future, nowait=nowait)
        self._lookups[req_id] = lookup
        lookup.future.add_done_callback(lambda _: self._lookup_done(req_id, lookup))

    def _lookup_done(self, req_id: str, lookup: _Lookup) -> None:
        """Completion callback (lookup thread, or here if already done)."""
        with self._pending_lock:
            self._num_pending_lookups -= 1
        if not lookup.future.cancelled() and lookup.future.exception() is not None:
            self.lookup_errors += 1  # only this thread writes it
        self._finished_lookups.append((req_id, lookup))

    def _exists(self, hashes: tuple[bytes, ...]) -> int:
        hit = len(hashes)
        for ns in self.namespaces:
            hit = min(hit, self.backend.exists_prefix(ns.object_keys(hashes[:hit])))
            if hit == 0:
                break
        return hit

    def must_wait(self, req_id: str) -> bool:
        """Should this request wait (``None`` from get_num_new_matched_tokens)?"""
        lookup = self._lookups.get(req_id)
        if lookup is None or lookup.nowait or not self.prefetch_policy.ever_waits:
            return False
        if (not lookup.done and lookup.op is None and lookup.future.done()
                and self._hit(lookup) < self.threshold_blocks):
            lookup.done = True  # a miss: nothing to wait for (idempotent)
        now = time.monotonic()
        wait = self.prefetch_policy.should_wait(lookup.done, now, lookup.deadline)
        if not wait and not lookup.done and not lookup.timed_out and now > lookup.deadline:
            lookup.timed_out = True
            self.prefetch_timed_out += 1
        return wait

    @staticmethod
    def _hit(lookup: _Lookup) -> int:
        try:
            return lookup.future.result()
        except Exception as exc:  # noqa: BLE001 - a failed lookup is a miss
            # One line, no traceback: a dead store fails every lookup.
            logger.warning("HiCache L3 lookup failed, counted as a miss: %r", exc)
            return 0

    def forget(self, req_id: str) -> None:
        lookup = self._lookups.pop(req_id, None)
        # A declined lookup still runs: its hit is counted and may be probed
        # (plan_prefetches), the only way a declined tier is measured again.
        if lookup is not None and not lookup.nowait:
            lookup.future.cancel()  # no-op if it already runs

    # --- per step ------------------------------------------------------------

    def plan_prefetches(self) -> list[PrefetchJob]:
        """Prefetch ops for the lookups that finished since the last step
        (each is considered once, as it finishes); the context's ``gate``
        (LoadGate) decides whether their requests wait for them."""
        if not self._finished_lookups:
            return []
        ctx = self._context()
        tree, alloc, gate = ctx.tree, ctx.alloc, ctx.gate
        jobs: list[PrefetchJob] = []
        while self._finished_lookups:
            req_id, lookup = self._finished_lookups.popleft()
            if self._lookups.get(req_id) is not lookup:
                if lookup.nowait and gate is not None and not lookup.future.cancelled():
                    hit = self._hit(lookup)
                    self._count_declined(gate, hit)  # it computed them instead
                    if gate.wants_l3_sample():
                        jobs += self._probe(lookup, hit, tree, alloc)
                continue  # its request is gone
            if lookup.op is None and not lookup.done:
                job = self._start_op(lookup, tree, alloc, gate)
                if job is not None:
                    jobs.append(job)
        return jobs

    def _start_op(self, lookup: _Lookup, tree: HiRadixTree, alloc: Alloc | None,
                  gate: LoadGateLike | None = None) -> PrefetchJob | None:
        lookup.done = True  # unless an op starts below
        end = lookup.start + self._hit(lookup)
        matched = tree.match(lookup.chain[:end]).pages
        start = lookup.start
        while start < len(matched) and matched[start] is not None:
            start += 1  # arrived in L2 meanwhile
        if lookup.nowait and gate is not None:
            self._count_declined(gate, end - lookup.start)  # what L3 found, now in L2 or not
            if gate.wants_l3_sample():
                return next(iter(self._probe(lookup, end - lookup.start, tree, alloc)), None)
        room = self.max_inflight_pages - self._inflight_pages
        num = min(end - start, room)
        if num < self.threshold_blocks:
            if end - start >= self.threshold_blocks:
                self.prefetch_revoked += 1  # the in-flight cap
            return None
        pages = _allocator(alloc)(lookup.chain, len(matched), num)
        if pages is None:
            self.prefetch_revoked += 1  # every page pinned
            return None
        if gate is not None and self.prefetch_policy.ever_waits and not lookup.nowait:
            gate.record("L3", True, num * self.block_size)
        op = _Op(next(self._op_ids), lookup.chain[: start + num], start, pages)
        self._ops[op.op_id] = op
        self.prefetch_started += 1
        self._inflight_pages += num
        lookup.op, lookup.done = op, False
        return PrefetchJob(op.op_id, op.chain[start:], tuple(pages))

    def _probe(self, lookup: _Lookup, hit: int, tree: HiRadixTree,
               alloc: Alloc | None) -> list[PrefetchJob]:
        """Read (part of) a declined hit nobody waits for, blocks already in
        L2 included, to measure L3 again: the only way a tier whose hits are
        all declined can show it got faster. Pages of blocks L2 already has
        are freed as the prefetch commits (``_advance``)."""
        num = min(hit, PROBE_BLOCKS, self.max_inflight_pages - self._inflight_pages)
        if num <= 0:
            return []
        chain = lookup.chain[: lookup.start + num]
        pages = _allocator(alloc)(chain, len(tree.match(chain).pages), num)
        if pages is None:
            return []
        op = _Op(next(self._op_ids), chain, lookup.start, pages)
        self._ops[op.op_id] = op
        self.prefetch_started += 1
        self._inflight_pages += num
        return [PrefetchJob(op.op_id, chain[lookup.start :], tuple(pages))]

    def _count_declined(self, gate: LoadGateLike, num_blocks: int) -> None:
        """A declined lookup found ``num_blocks`` blocks its request computes instead."""
        if num_blocks >= self.threshold_blocks:
            gate.record("L3", False, num_blocks * self.block_size)

    def plan_backup(self, stored: list[PinnedRange], step: int) -> list[BackupJob]:
        """One backup op for this step's stored pages (their STORE ops pin
        them now; the BACKUP op keeps them pinned until every rank acked)."""
        if not stored:
            return []
        op = self._context().ops.open(OpKind.BACKUP, step, stored)
        hashes = tuple(r.chain[i] for r in stored for i in r.blocks)
        pages = tuple(p for r in stored for p in r.pages)
        states = (tuple(map(self.page_states.valid, pages)) if self.page_states is not None
                  else ())
        self._backups[op.op_id] = op
        self.backed_up_blocks += len(pages)
        return [BackupJob(op.op_id, hashes, pages, states)]

    def plan_backups(self, stored: list[PinnedRange], step: int) -> list[BackupJob]:
        """This step's stored pages go out while fewer than
        ``max_backup_pages`` are in flight (so the bound is overshot by one
        step's stores at most, and a step's stores are never split); else
        they are deferred to the backlog. Room left flushes the backlog."""
        room = self.max_backup_pages - self._backup_pages
        now: list[PinnedRange] = []
        if room > 0:
            now = list(stored)
            room -= sum(len(r.blocks) for r in stored)
        else:
            for rng in stored:
                self.backup_deferred += len(rng.blocks)
                self.backup_dropped += self.backlog.defer(rng.chain, rng.blocks)
        if room > 0 and len(self.backlog):
            now += self._flush(self._context().tree, room)
        jobs = self.plan_backup(now, step)
        for job in jobs:  # the bound counts these; an attach's backfill has its own
            self._bounded[job.op_id] = len(job.pages)
            self._backup_pages += len(job.pages)
        return jobs

    def _flush(self, tree: HiRadixTree, room: int) -> list[PinnedRange]:
        """Up to ``room`` deferred blocks whose pages are still in L2."""
        ranges = []
        for entry in self.backlog.take(room):
            pages = tree.match(entry.chain).pages
            picked = [(b, page) for b, page in
                      ((b, pages[b]) for b in entry.blocks if b < len(pages))
                      if page is not None]
            self.backup_evicted += len(entry.blocks) - len(picked)
            if picked:
                blocks = tuple(b for b, _ in picked)
                self.backup_flushed += len(blocks)
                ranges.append(PinnedRange(entry.chain[: blocks[-1] + 1], blocks,
                                          tuple(page for _, page in picked)))
        return ranges

    def note_use(self, hashes) -> None:
        """A request used these blocks (its hit): deferred backups of them gain value."""
        self.backlog.record_use(hashes)

    # --- admin (runtime attach, admin/storage_control.py) --------------------------------

    def in_flight(self) -> dict[str, int]:
        """Work that still uses the backend: open backups and prefetches,
        lookups queued or running."""
        return {"backups": len(self._backups), "prefetches": len(self._ops),
                "lookups": self._num_pending_lookups}

    def is_backup_open(self, op_id: int) -> bool:
        return op_id in self._backups

    def update_policy(self, cfg: StorageConfig) -> None:
        """New prefetch policy and knobs for the same backend and options;
        lookups already started keep their deadlines."""
        self.cfg = cfg
        self.threshold_blocks = max(1, -(-cfg.prefetch_threshold // self.block_size))
        self.prefetch_policy = PrefetchPolicy(
            cfg.prefetch_policy, cfg.prefetch_timeout_base, cfg.prefetch_timeout_per_ki_token,
            cfg.prefetch_timeout_max)

    def awaits_io(self) -> bool:
        """Lookups still running, prefetches not yet acknowledged, or
        deferred backups to catch up on."""
        return bool(self._ops) or self._num_pending_lookups > 0 or len(self.backlog) > 0

    def prefetch_pages(self) -> set[int]:
        """Pages open prefetches hold outside the tree (not yet committed)."""
        return {p for op in self._ops.values() for p in op.pages[op.committed:]}

    # --- completions -------------------------------------------------------

    def on_worker_meta(self, meta: HiCacheWorkerMetadata) -> None:
        ctx = self._context()
        tree, ops, events = ctx.tree, ctx.ops, ctx.events
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
        for op_id, hashes in meta.backup_failures.items():
            if op_id in self._backups:  # reported before (or with) that rank's ack
                self._backup_failures.setdefault(op_id, set()).update(hashes)
        for op_id, ranks in meta.backups.items():
            self._ack_backup(op_id, ranks, ops, events)

    def _advance(self, op: _Op, tree: HiRadixTree, events: EventLog | None = None) -> None:
        if len(op.progress) < self.world_size:
            return
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
        if all(p.finished for p in op.progress.values()):
            leftover = op.pages[op.committed :]
            if leftover:
                tree.free(leftover)
                self.prefetch_incomplete += 1
                if events is not None:
                    # Found by the lookup, then missing or invalid: not
                    # reachable by prefix from here.
                    events.removed(MEDIUM_L3, op.chain[op.start + op.committed :],
                                   self.backend.name)
            self._inflight_pages -= len(op.pages)
            del self._ops[op.op_id]
            for lookup in self._lookups.values():
                if lookup.op is op:
                    lookup.done = True

    def _ack_backup(self, op_id: int, ranks: set[int], ops: PageOps,
                    events: EventLog | None = None) -> None:
        if op_id not in self._backups:
            return  # a duplicate or late ack of a finished backup
        acked = self._backup_acks.setdefault(op_id, set())
        acked |= ranks
        if len(acked) >= self.world_size:
            del self._backup_acks[op_id]
            op = self._backups.pop(op_id)
            self._backup_pages -= self._bounded.pop(op_id, 0)
            failed = self._backup_failures.pop(op_id, ())
            if events is not None and events.enabled:
                for rng in op.ranges:
                    blocks = [i for i in rng.blocks if rng.chain[i] not in failed]
                    events.stored(MEDIUM_L3, rng.chain, blocks, ownership=self.backend.name)
            ops.close(op)

    def prefetched_range(self, req_id: str) -> tuple[int, int] | None:
        """Blocks [lo, hi) of the request that its own prefetch put into L2."""
        lookup = self._lookups.get(req_id)
        if lookup is None or lookup.op is None:
            return None
        return lookup.op.start, lookup.op.start + lookup.op.committed

    def clear_storage(self) -> None:
        """Admin: remove every object from L3 (reset_cache leaves L3 alone)."""
        self.backend.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.backend.close()


def _placed(tree: HiRadixTree, chain, new: list, lo: int, some_unused: bool) -> list[int]:
    """Blocks of ``chain[lo:]`` that now hold the pages in ``new`` (all of
    them, unless the tree already had some: then look)."""
    if not some_unused:
        return list(range(lo, len(new)))
    pages = tree.match(chain).pages
    return [i for i in range(lo, len(new)) if i < len(pages) and pages[i] == new[i]]
