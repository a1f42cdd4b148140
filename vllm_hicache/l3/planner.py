"""Scheduler half of the L3 tier: lookups, prefetch ops, backup ops.

Lookup: when a request arrives, the blocks beyond what L1/L2 hold are looked
up in L3 (``exists_prefix``, min over TP ranks) on a background thread, so
the scheduler never waits on I/O (l3/lookups.py runs them; this module
decides what they lead to). Prefetch: in ``build_connector_meta`` a finished
lookup whose hit passes ``prefetch_threshold`` (a fixed number of tokens,
or under ``auto`` the load decision's cost model: ``LoadGate``) gets host
pages (bounded by the in-flight cap) and becomes a PrefetchJob for the
workers; its op (l3/prefetch_ops.py) inserts the pages all ranks have
verified into the tree as they report: ordinary L2 hits from then on. Backup
(l3/backups.py; the planner owns it as ``backups``, which callers use directly):
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

A lookup the request would wait for is given a moment to answer in the
same schedule pass (``must_wait``): each step may spend at most
``LOOKUP_WAIT_PER_STEP_S`` (l3/lookups.py) in total waiting on lookups. A
store that answers in that time (a local file system, a warm cache) saves
the request a whole step: a miss is admitted at once instead of one step
later, and a hit's prefetch leaves with this step's metadata. A slower store
costs each step at most the budget, and the request simply waits, as before.

The circuit breaker (``health``, l3/health_check.py): its answer is read
once per step (``begin_step``) and holds for what that step sends the
workers; a new request's lookup also asks it directly. While it is not
closed, the store is not used: new requests are not looked up, finished
lookups start no prefetch and nobody waits for one, stored pages are not
backed up and the backlog is dropped (all counted); prefetches and backups
already sent end as they would.

Exact removals (l3/removals.py): object keys a worker's client evicted
(reported in its metadata) or the store reported removing (this process's
client, polled every step) become ``BlockRemoved`` for ``STORAGE``, after
the step's backup acknowledgements, and a removed block of a backup still
open is left out of its ``BlockStored``, so a consumer's last word on a
block is the store's state.

Admission, exclusive mode, the backlog and write budgets: l3/backups.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vllm_hicache.common.events import MEDIUM_L3, EventLog
from vllm_hicache.common.jobs import BackupJob, BlockCopy, PrefetchJob, SameStepLoad
from vllm_hicache.common.page_ops import PageOps, PinnedRange
from vllm_hicache.common.page_states import PageStates
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.backups import L3Backups, PickL2Only
from vllm_hicache.l3.breaker import STATE_GAUGE, BreakerState
from vllm_hicache.l3.canary import is_canary_key
from vllm_hicache.l3.health_check import L3Health
from vllm_hicache.l3.lookups import L3Lookup, L3Lookups
from vllm_hicache.l3.node_events import NodeTierEvents
from vllm_hicache.l3.prefetch_ops import Alloc, PrefetchOps, allocator
from vllm_hicache.l3.removals import RemovedKeys
from vllm_hicache.l3.report_wait import step_budget_s
from vllm_hicache.policy.admission import ALWAYS, AdmissionRule, L3Mode
from vllm_hicache.policy.prefetch import (
    PREFETCH_THRESHOLD_AUTO,
    PrefetchPolicy,
    min_prefetch_blocks,
)
from vllm_hicache.policy.same_step import read_wait_s
from vllm_hicache.policy.write_budget import REASON_BANDWIDTH, REASON_DAY, WriteBudget
from vllm_hicache.storage import StorageBackend
from vllm_hicache.storage.node_chain import NodeChainBackend
from vllm_hicache.storage.node_keys import split_tier_changes
from vllm_hicache.storage_config import StorageConfig

logger = logging.getLogger(__name__)


class LoadGateLike(Protocol):
    """What the planner asks the scheduler half's LoadGate (scheduler/load_gate.py)."""

    def prefetch_l3(self, start: int, num_tokens: int, num_pages: int) -> bool: ...

    def wants_l3_sample(self) -> bool: ...

    def record(self, tier: str, loaded: bool, num_tokens: int) -> None: ...

    def observe_l3_latency(self, seconds: float) -> None: ...


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
    # The scheduler half can admit an L3 hit in the step its read is sent
    # (l3/same_step.py: synchronous loads, one KV cache group).
    same_step: bool = False


class L3Planner:
    def __init__(self, cfg: StorageConfig, backend: StorageBackend, namespaces: list[KeyNamespace],
                 block_size: int, world_size: int, max_inflight_pages: int,
                 ctx: PlannerContext | None = None, max_backup_pages: int | None = None,
                 page_states: PageStates | None = None, admission: AdmissionRule = ALWAYS,
                 mode: L3Mode = L3Mode.INCLUSIVE, health: L3Health | None = None,
                 block_bytes: int = 0) -> None:
        self.cfg = cfg
        # The circuit breaker (None: off, the store is always used), and its
        # answer for this step (begin_step).
        self.health = health
        self._usable = True
        self.breaker_skipped_lookups = 0
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
        self._set_threshold(cfg)
        self.prefetch_policy = PrefetchPolicy(
            cfg.prefetch_policy, cfg.prefetch_timeout_base, cfg.prefetch_timeout_per_ki_token,
            cfg.prefetch_timeout_max)
        # The store's lookups of arriving requests (l3/lookups.py).
        self.lookups = L3Lookups(backend, namespaces)
        # Exact L3 removals: keys back to block hashes, and blocks announced.
        self.removals = RemovedKeys(namespaces, skip=is_canary_key)
        # Prefetch ops sent and not yet finished (l3/prefetch_ops.py).
        self.prefetches = PrefetchOps(self.lookups, self.removals, backend.name, world_size,
                                      max_inflight_pages, page_states)
        self.same_step_admitted = 0
        self.skipped_lookups = 0
        # For metrics (stats.planner_samples).
        self.prefetch_revoked = 0
        self.prefetch_timed_out = 0
        # Hits prefetch_threshold=auto left to vLLM: the cost model expected
        # computing them to be faster.
        self.prefetch_not_worth = 0
        self.mode = mode
        self.backups = L3Backups(ctx, backend, self.removals, block_size, world_size,
                                 max_inflight_pages, max_backup_pages, page_states, admission,
                                 mode, cfg.write_budget, block_bytes)
        # NODE events and counts, with a node tier (l3/node_events.py).
        self.node_events = (NodeTierEvents(backend.tier.name, namespaces, self.removals)
                            if isinstance(backend, NodeChainBackend) else None)
        self.l3_removed_blocks = 0

    @property
    def lookups_started(self) -> int:
        """Lookups handed to the lookup thread."""
        return self.lookups.started

    @property
    def lookup_errors(self) -> int:
        return self.lookups.errors

    @property
    def generation(self) -> int:
        """The backend generation this planner's jobs belong to (an admin
        replace makes a new one; jobs.py)."""
        return self.prefetches.generation

    @property
    def prefetch_started(self) -> int:
        return self.prefetches.started

    @property
    def prefetched_blocks(self) -> int:
        return self.prefetches.prefetched_blocks

    @property
    def prefetch_incomplete(self) -> int:
        return self.prefetches.incomplete

    @property
    def write_budget(self) -> WriteBudget:
        return self.backups.budget.bucket

    @property
    def block_bytes(self) -> int:
        """One block's bytes in L3, all ranks' objects (what a backup spends)."""
        return self.backups.budget.block_bytes

    @property
    def l3_removed_unmapped(self) -> int:
        return self.removals.unmapped

    @property
    def budget_skipped_bandwidth(self) -> int:
        return self.backups.budget.skipped[REASON_BANDWIDTH]

    @property
    def budget_skipped_day(self) -> int:
        return self.backups.budget.skipped[REASON_DAY]

    def _context(self) -> PlannerContext:
        """The scheduler state; planning or completing ops without it is a bug."""
        if self.ctx is None:
            raise RuntimeError("this L3Planner was built without a PlannerContext "
                               "(lookups only): it cannot plan or complete page ops")
        return self.ctx

    # --- the circuit breaker ------------------------------------------------

    def begin_step(self) -> None:
        """Read the breaker once for this step; on a trip, let go of what
        would use the store later: the backlog (dropped, counted) and the
        waits of lookups in flight."""
        usable = self.health.usable if self.health is not None else True
        if self._usable and not usable:
            self.backups.drop_for_breaker()
            for lookup in self.lookups:
                if lookup.op is None:
                    lookup.done = True
        self._usable = usable

    @property
    def usable(self) -> bool:
        """The store is used this step (the breaker is closed, or off)."""
        return self._usable

    @property
    def breaker_trips(self) -> int:
        return self.health.trips if self.health is not None else 0

    def breaker_gauge(self) -> int:
        """stats.METRICS l3_breaker_state: 0 closed (or off), 1 tripped, 2 probing."""
        state = self.health.state if self.health is not None else BreakerState.CLOSED
        return STATE_GAUGE[state]

    def breaker_status(self) -> dict[str, object]:
        """The admin API's view of the breaker."""
        return self.health.status() if self.health is not None else {"state": "off"}

    # --- lookups -----------------------------------------------------------

    def start_lookup(self, req_id: str, chain: tuple[bytes, ...], start: int) -> None:
        """Look up blocks [start, len(chain)) of a new request in L3. With a
        ``gate`` (LoadGate), under a waiting policy, the request waits only
        if a hit as long as the chain is expected to arrive sooner than
        vLLM would compute it (decided once, here: it must not wait for
        the lookup either)."""
        if len(chain) - start < self.threshold_blocks:
            return
        # The breaker's live answer: a lookup concerns no worker, so it need
        # not wait for the step that makes a trip everyone's.
        if not self._usable or (self.health is not None and not self.health.usable):
            self.breaker_skipped_lookups += 1  # a miss, at once
            return
        if self.lookups.full():
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
        self.lookups.start(req_id, chain, start, deadline, nowait)

    def _set_threshold(self, cfg: StorageConfig) -> None:
        self.threshold_blocks = min_prefetch_blocks(cfg.prefetch_threshold, self.block_size)
        self.threshold_by_cost = cfg.prefetch_threshold == PREFETCH_THRESHOLD_AUTO

    def _worth_fetching(self, gate: LoadGateLike | None, start: int, num: int) -> bool:
        """Under prefetch_threshold=auto: is fetching blocks [start, start +
        num) expected to beat computing them? (No gate: yes.)"""
        if not self.threshold_by_cost or gate is None:
            return True
        bs = self.block_size
        return gate.prefetch_l3(start * bs, num * bs, num)

    def must_wait(self, req_id: str, resident: int = 0) -> bool:
        """Should this request wait (``None`` from get_num_new_matched_tokens)?
        ``resident``: its leading blocks vLLM's own cache holds now (a
        same-step read starts after them)."""
        lookup = self.lookups.get(req_id)
        if (lookup is None or lookup.nowait or not self.prefetch_policy.ever_waits
                or not self._usable):
            return False
        self.lookups.await_answer(lookup)
        if self._start_same_step(lookup, resident):
            return False  # admitted with the read (same_step_pages), if vLLM has room
        if (not lookup.done and lookup.op is None and lookup.future.done()
                and self.lookups.hit(lookup) < self.threshold_blocks):
            lookup.done = True  # a miss: nothing to wait for (idempotent)
        now = time.monotonic()
        wait = self.prefetch_policy.should_wait(lookup.done, now, lookup.deadline)
        if lookup.op is not None:
            lookup.op.waited = wait
        if not wait and not lookup.done and not lookup.timed_out and now > lookup.deadline:
            lookup.timed_out = True
            self.prefetch_timed_out += 1
        return wait

    def _start_same_step(self, lookup: L3Lookup, resident: int) -> bool:
        """Under same_step_read_wait_ms, a lookup that has answered with a
        hit starts its prefetch now, to be sent with this step; True while
        such a prefetch is unsent (its request can be admitted with it)."""
        if lookup.op is not None:
            return lookup.op.unsent
        ctx = self._context()
        if (not ctx.same_step or self.cfg.same_step_read_wait_ms <= 0 or lookup.done
                or not lookup.future.done()):
            return False
        job = self._start_op(lookup, ctx.tree, ctx.alloc, ctx.gate, resident)
        if job is None or lookup.op is None:
            return False
        self.prefetches.hold(lookup.op, job)
        return True

    def same_step_pages(self, req_id: str, block: int | None = None) -> list[int]:
        """Pages of the request's unsent same-step prefetch, if it fills
        blocks from ``block`` on (right behind its L2 hit; None: from
        wherever it starts); else none."""
        lookup = self.lookups.get(req_id)
        op = lookup.op if lookup is not None else None
        if op is None or not op.unsent or (block is not None and op.start != block):
            return []
        return op.pages

    def claim_same_step(self, req_id: str, block_ids: Sequence[int]) -> SameStepLoad:
        """The request was admitted with the first ``len(block_ids)`` pages
        of its same-step prefetch (same_step_pages): its L1 copies."""
        lookup = self.lookups.get(req_id)
        assert lookup is not None, req_id
        op = lookup.op
        assert op is not None and op.unsent and len(block_ids) <= len(op.pages), req_id
        op.same_step = len(block_ids)
        self.same_step_admitted += 1
        wait_s = read_wait_s(self.cfg.same_step_read_wait_ms,
                             lookup.deadline - time.monotonic())
        return SameStepLoad(req_id, op.op_id, BlockCopy(tuple(block_ids),
                                                        tuple(op.pages[: len(block_ids)])),
                            wait_s, self.generation)

    def forget(self, req_id: str) -> None:
        lookup = self.lookups.forget(req_id)
        if lookup is not None and lookup.op is not None:
            lookup.op.waited = False

    # --- per step ------------------------------------------------------------

    def plan_prefetches(self) -> list[PrefetchJob]:
        """Prefetch ops for the lookups that finished since the last step
        (each is considered once, as it finishes); the context's ``gate``
        (LoadGate) decides whether their requests wait for them. Ends the
        schedule pass: the next one may wait on lookups afresh."""
        self.lookups.new_pass()
        # Started in the pass (same-step), whatever the breaker says now: their
        # pages are allocated and a load may wait on them.
        return self.prefetches.take_unsent() + self._plan_finished_lookups()

    def _plan_finished_lookups(self) -> list[PrefetchJob]:
        if not self.lookups.has_finished():
            return []
        if not self._usable:  # their requests compute the blocks
            for _, lookup in self.lookups.take_finished():
                lookup.done = True
            return []
        ctx = self._context()
        tree, alloc, gate = ctx.tree, ctx.alloc, ctx.gate
        if gate is not None:
            for seconds in self.lookups.take_seconds():
                gate.observe_l3_latency(seconds)
        jobs: list[PrefetchJob] = []
        for req_id, lookup in self.lookups.take_finished():
            if self.lookups.get(req_id) is not lookup:
                if lookup.nowait and gate is not None and not lookup.future.cancelled():
                    hit = self.lookups.hit(lookup)
                    self._count_declined(gate, hit)  # it computed them instead
                    if gate.wants_l3_sample():
                        jobs += self.prefetches.probe(lookup, hit, tree, alloc)
                continue  # its request is gone
            if lookup.op is None and not lookup.done:
                job = self._start_op(lookup, tree, alloc, gate)
                if job is not None:
                    jobs.append(job)
        return jobs

    def _start_op(self, lookup: L3Lookup, tree: HiRadixTree, alloc: Alloc | None,
                  gate: LoadGateLike | None = None, resident: int = 0) -> PrefetchJob | None:
        """The lookup's prefetch op, from block ``resident`` on at the
        earliest (blocks L1 holds now: a request sharing a prefix with one
        admitted a moment ago need not read it again)."""
        lookup.done = True  # unless an op starts below
        end = lookup.start + self.lookups.hit(lookup)
        matched = tree.match(lookup.chain[:end]).pages
        start = max(lookup.start, resident)
        while start < len(matched) and matched[start] is not None:
            start += 1  # arrived in L2 meanwhile
        if lookup.nowait and gate is not None:
            self._count_declined(gate, end - lookup.start)  # what L3 found, now in L2 or not
            if gate.wants_l3_sample():
                return next(iter(self.prefetches.probe(lookup, end - lookup.start, tree, alloc)),
                            None)
        room = self.prefetches.room_pages
        num = min(end - start, room)
        if num < self.threshold_blocks:
            if end - start >= self.threshold_blocks:
                self.prefetch_revoked += 1  # the in-flight cap
            return None
        if not self._worth_fetching(gate, start, num):
            self.prefetch_not_worth += 1
            return None
        pages = allocator(alloc)(lookup.chain, len(matched), num)
        if pages is None:
            self.prefetch_revoked += 1  # every page pinned
            return None
        if gate is not None and self.prefetch_policy.ever_waits and not lookup.nowait:
            gate.record("L3", True, num * self.block_size)
        return self.prefetches.start(lookup, start, pages,
                                     waited=self.prefetch_policy.ever_waits and not lookup.nowait)

    def report_wait_s(self) -> float:
        """How long the workers may wait for open prefetches before this
        step's report (l3/report_wait.py): only while a request waits for one."""
        waits = self._usable and self.prefetch_policy.ever_waits  # else must_wait says no
        return step_budget_s(waits and any(op.waited for op in self.prefetches))

    def _count_declined(self, gate: LoadGateLike, num_blocks: int) -> None:
        """A declined lookup found ``num_blocks`` blocks its request computes instead."""
        if num_blocks >= self.threshold_blocks:
            gate.record("L3", False, num_blocks * self.block_size)

    # --- backups (l3/backups.py) ----------------------------------------------

    def plan_backups(self, stored: list[PinnedRange], step: int,
                     pick: PickL2Only | None = None) -> list[BackupJob]:
        """This step's stored pages, as far as L3's admission rule admits
        them (exclusive mode: the held pages L2 needs the room of), go out
        while fewer than ``max_backup_pages`` are in flight (so the bound
        is overshot by one step's stores at most, and a step's stores are
        never split); else they are deferred to the backlog. Room left
        flushes the backlog, or goes to ``pick(tree, room)`` when given (a
        graceful stop's choice of L2-only pages, scheduler/graceful_stop.py;
        exclusive mode then releases every hold it has room for). Nothing is
        written while the breaker is not closed (the blocks are counted;
        exclusive mode releases the holds L2 needs the room of unwritten, so
        L2 never fills with holds)."""
        if self.ctx is not None:  # once per step: removals this process's client heard of
            self._announce_removed(self.backend.take_removed_keys(), self.ctx.events)
        return self.backups.plan_backups(stored, step, self._usable, pick)

    def check(self) -> list[str]:
        """Problems with what this planner holds in L2 (empty when all is well)."""
        return self.backups.check()

    # --- admin (runtime attach, admin/storage_control.py) --------------------------------

    def in_flight(self) -> dict[str, int]:
        """Work that still uses the backend: open backups and prefetches,
        lookups queued or running."""
        return {"backups": self.backups.num_open(), "prefetches": self.prefetches.num_open(),
                "lookups": self.lookups.num_pending}

    def set_generation(self, generation: int) -> None:
        """Tag this planner's jobs and prefetch op ids with ``generation``;
        before it plans anything."""
        if self.prefetches.num_open() or self.backups.num_open():
            raise RuntimeError("set_generation after ops were planned")
        self.prefetches.set_generation(generation)
        self.backups.generation = generation

    def stop_lookups(self) -> None:
        """A replace or detach: no request waits on this planner any more
        (its successor, or none, answers must_wait); lookups not yet run are
        cancelled. Open ops still complete as their reports arrive."""
        self.lookups.stop()
        for op in self.prefetches:
            op.waited = False
        # Same-step prefetches this pass started are never sent now: the
        # loads that wait on them find no read (recomputed).
        self.prefetches.abort_unsent(self._context().tree if self.ctx is not None else None)

    def is_idle(self) -> bool:
        """No prefetch or backup open (lookups aside)."""
        return not self.prefetches.num_open() and not self.backups.num_open()

    def update_policy(self, cfg: StorageConfig) -> None:
        """New prefetch policy and knobs for the same backend and options;
        lookups already started keep their deadlines."""
        if cfg.write_budget != self.cfg.write_budget:
            self.backups.budget.reconfigure(cfg.write_budget)
        self.cfg = cfg
        self._set_threshold(cfg)
        self.prefetch_policy = PrefetchPolicy(
            cfg.prefetch_policy, cfg.prefetch_timeout_base, cfg.prefetch_timeout_per_ki_token,
            cfg.prefetch_timeout_max)

    def awaits_io(self) -> bool:
        """Lookups still running, prefetches not yet acknowledged, or
        deferred backups to catch up on."""
        return (self.prefetches.num_open() > 0 or self.lookups.num_pending > 0
                or len(self.backups.backlog) > 0)

    def prefetch_pages(self) -> set[int]:
        """Pages open prefetches hold outside the tree (not yet committed)."""
        return self.prefetches.uncommitted_pages()

    # --- completions -------------------------------------------------------

    def on_worker_meta(self, meta: HiCacheWorkerMetadata) -> None:
        ctx = self._context()
        tree, ops, events = ctx.tree, ctx.ops, ctx.events
        self.prefetches.on_worker_meta(meta, tree, events)
        self.backups.on_reports(meta.backup_failures, meta.backups, ops, events)
        if meta.l3_removed_keys:  # after the acks: a removal is the later word
            self._announce_removed(meta.l3_removed_keys, events)

    def _announce_removed(self, keys, events: EventLog | None) -> None:
        """``keys`` are gone from L3: announce their blocks, and keep them out
        of the BlockStored of backups still open."""
        if not keys:
            return
        keys, node_changes = split_tier_changes(keys)
        if self.node_events is not None:
            self.node_events.apply(node_changes, events)
        hashes = self.removals.block_hashes(keys)
        if not hashes:
            return
        self.l3_removed_blocks += len(hashes)
        self.backups.fail_removed(set(hashes))
        if events is not None:
            events.removed(MEDIUM_L3, hashes, self.backend.name)

    def prefetched_range(self, req_id: str) -> tuple[int, int] | None:
        """Blocks [lo, hi) of the request that its own prefetch put into L2."""
        return self.prefetches.prefetched_range(req_id)

    def node_range(self, req_id: str) -> tuple[int, int] | None:
        """Of those, the blocks its lookup had found in the node tier."""
        return self.prefetches.node_range(req_id)

    def hit_stages(self, req_id: str, admitted: float) -> dict[str, float] | None:
        """Where the wait of its hit went (PrefetchOps.hit_stages)."""
        return self.prefetches.hit_stages(req_id, admitted)

    def clear_storage(self) -> None:
        """Admin: remove every object from L3 (reset_cache leaves L3 alone)."""
        self.backend.clear()

    def close(self) -> None:
        if self.health is not None:
            self.health.close()
        self.lookups.close()
        self.backend.close()
