"""Scheduler half: owns the HiRadixTree and every L2 decision.

Runs in EngineCore. It never touches KV bytes and never waits on I/O beyond
a bounded moment for L3 lookups to answer (l3/planner.py, at most 2 ms a
step; the workers as long for prefetches a request waits on: l3/report_wait.py);
it emits per-step operations (``HiCacheMetadata``) that the workers execute.

Page lifetime (ranges in blocks of one request)::

    [0, local)            vLLM's own prefix-cache hit (L1); its L2 copies
                          are touched, so L2 keeps what L1 finds hot
    [local, local+n)      L2 hit: pages pinned by update_state_after_alloc,
                          loaded this step (layerwise) or between steps (async)
    [stored, done)        computed by this step: pages allocated, inserted and
                          pinned at once, copied by the workers after the forward

Every pin belongs to an operation in ``PageOps`` (page_ops.py) and is
released at that operation's terminal event, so an allocation later in the
same step can never evict a page a copy still uses; when every page is
pinned, a store simply stores less. Tree mutations that can evict (alloc)
happen only in build_connector_meta and reset_cache, never between a lookup
and its update_state_after_alloc, so a page reported as a hit is still there
when it is pinned (a same-step L3 read, l3/same_step.py, allocates inside a
lookup, before that request's own match: vLLM pairs each lookup with its
update_state_after_alloc in one iteration, so every earlier hit is pinned by
then). A copy the workers report as failed takes its page (and
what hangs below it) out of the index, so it is never a hit again
(failed_copies.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from vllm_hicache.common.events import MEDIUM_L2, EventLog
from vllm_hicache.common.jobs import (
    BackupJob,
    BlockPage,
    LoadJob,
    NodeLoadJob,
    SameStepLoad,
    StorageCommand,
    merge_copies,
)
from vllm_hicache.common.node_counts import InstanceNodeCounts
from vllm_hicache.common.page_ops import OpKind, PageOps, PinnedRange
from vllm_hicache.common.page_states import PageStates
from vllm_hicache.common.stats import HiCacheStats, SchedulerReport, key
from vllm_hicache.config import HiCacheConfig, LoadMode
from vllm_hicache.connector.geometry import KVGeometry, host_num_pages
from vllm_hicache.connector.metadata import HiCacheMetadata, HiCacheWorkerMetadata
from vllm_hicache.host.memory import check_fits
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import loadable_block_limit
from vllm_hicache.l3 import same_step
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.policy import make_eviction_policy
from vllm_hicache.policy.same_step import check_same_step_policy
from vllm_hicache.policy.stop_budget import stop_budget
from vllm_hicache.policy.write import WritePolicy, WritePolicyName, hit_counter_slots
from vllm_hicache.scheduler import hit_tiers
from vllm_hicache.scheduler.access_log import open_access_log
from vllm_hicache.scheduler.arrivals import Arrivals
from vllm_hicache.scheduler.failed_copies import FailedCopies
from vllm_hicache.scheduler.graceful_stop import GracefulStop
from vllm_hicache.scheduler.group_blocks import GroupBlocks
from vllm_hicache.scheduler.hit_timer import HitStageTimer
from vllm_hicache.scheduler.inflight import InflightLoads
from vllm_hicache.scheduler.load_gate import LoadGate
from vllm_hicache.scheduler.node_hits import NodeAdmission
from vllm_hicache.scheduler.pd import loads_hits
from vllm_hicache.scheduler.request_state import Lookup, ReqState, track_scheduled
from vllm_hicache.scheduler.stall_watch import StallWatch
from vllm_hicache.scheduler.store_planner import L2StorePlanner
from vllm_hicache.scheduler.write_back import EvictionWriteBacks

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# Steps that schedule nothing while requests wait on L3 or async loads
# start at least this far apart: a loop that stepped back to back would spin
# about a thousand empty steps per wait, on the cores the I/O threads need.
# Only the shortfall is slept: vLLM 0.32 already sleeps a millisecond after
# an empty step while the connector has work (EngineCoreProc
# ._process_engine_step), and a second pause would double the wait of a
# request arriving then, and of a completion being noticed.
EMPTY_STEP_PAUSE_S = 0.001


class StepCommands(Protocol):
    """Work the admin side runs on the engine loop, between steps
    (admin/storage_control.py): the scheduler half calls it, never the
    other way round."""

    def on_step(self, num_running: int) -> StorageCommand | None: ...

    def plan_backfill(self, step: int) -> list[BackupJob]: ...

    def on_acks(self, acks: Mapping[int, Mapping[int, str]]) -> None: ...

    def on_worker_meta(self, meta: HiCacheWorkerMetadata) -> None: ...

    def has_work(self) -> bool: ...

    def scratch_pages(self) -> set[int]: ...


# Builds the L3 planner: (num_pages, page_states, the scheduler's context).
L3Factory = Callable[[int, "PageStates | None", PlannerContext], L3Planner]


class HiCacheScheduler:
    def __init__(
        self,
        cfg: HiCacheConfig,
        geom: KVGeometry,
        local_ranks: int = 1,
        l3_factory: L3Factory | None = None,
    ) -> None:
        """``l3_factory(num_pages, page_states, ctx)`` builds the L3 planner,
        when a storage backend is configured, once L2 is known to fit."""
        self.cfg = cfg
        self.block_size = geom.block_size
        # Hybrid models: copies name each group's blocks (geometry.group_block_id).
        self.geom = geom
        self._groups = GroupBlocks(geom)
        self.num_pages = host_num_pages(cfg, geom)
        # Every rank on this host allocates its own pool: refuse before the
        # tree (or any worker) allocates anything.
        check_fits(self.num_pages * geom.sizing_bytes_per_block * local_ranks)
        self.tree = HiRadixTree(
            self.num_pages,
            make_eviction_policy(cfg.radix_eviction_policy),
            on_evict=self._on_l2_evict,
        )
        self.load_async = cfg.hicache_load_mode == LoadMode.ASYNC
        # False on a PD decode-offload instance (pd.py): NixlConnector alone loads.
        self.serves_hits = loads_hits(cfg)
        self.stats = HiCacheStats()
        # This instance's node tier page counts (common/node_counts.py).
        self.node_counts = InstanceNodeCounts()
        # The one record per request (request_state.py): made by _record,
        # dropped by request_finished.
        self._reqs: dict[str, ReqState] = {}
        self.ops = PageOps(self.tree)
        # What the workers' failed copies leave wrong, dropped (failed_copies.py).
        self.failed_copies = FailedCopies(self.tree, self.ops, self.stats, self._reqs)
        # The step being scheduled; build_connector_meta ends it.
        self._step = 0
        # has_pending_work: how long pending work went without progress.
        self.stall_watch = StallWatch()
        self._last_empty_step = float("-inf")  # monotonic seconds (_space_empty_step)
        self._step_loads: list[LoadJob] = []
        self._step_async_loads: list[LoadJob] = []
        self._step_node_loads: list[NodeLoadJob] = []
        self._step_same_step: list[SameStepLoad] = []
        self._inflight = InflightLoads()
        # The engine's start line (connector.start_line) reports the sizes.
        # Models with a state group: which pages hold a usable state.
        self.page_states = PageStates(self.num_pages) if geom.mamba_groups else None
        self.stores = L2StorePlanner(
            self.tree, self.ops, self._groups,
            WritePolicy(cfg.hicache_write_policy, hit_counter_slots(self.num_pages),
                        cfg.l2_admission(), self.block_size), self.stats,
            self.page_states, self.block_size, EventLog(False, self.block_size))
        # Under write_back: the copies vLLM's L1 evictions ask for (write_back.py).
        self.write_backs = EvictionWriteBacks(self.stores, self.stats, lambda: self._step)
        # hicache_load_decision (load_gate.py): its estimators.
        self.load_gate = LoadGate(cfg.hicache_load_decision, geom.bytes_per_block)
        # Node-tier hits loaded into L1 directly (node_hits.py).
        self.node_hits = NodeAdmission(self.block_size, self.load_gate, cfg.hicache_mem_layout,
                                       self.page_states is not None, self._groups.hybrid)
        # Controls read and L3 lookups started as requests arrive (arrivals.py).
        self.arrivals = Arrivals(self.tree, self.node_hits, self.stats, self.block_size)
        # What the L3 planner acts on (its own and a runtime attach's).
        self._l3_ctx = PlannerContext(self.tree, self.ops, self.stores.alloc_protecting,
                                      self.load_gate, self.stores.events,
                                      self._admits_same_step(cfg.storage))
        self._l3: L3Planner | None = (l3_factory(self.num_pages, self.page_states, self._l3_ctx)
                                      if l3_factory else None)
        # Runtime attach/detach of L3 (admin API): install_commands.
        self.storage_control: StepCommands | None = None
        self._report = SchedulerReport()
        # hicache_access_log, for the capacity planner (a no-op when off).
        self.access_log = open_access_log(cfg, geom, self.num_pages, local_ranks)
        # Where the wait of each L3 hit went (l3/hit_stages.py), for metrics.
        self.hit_timer = HitStageTimer()
        # vLLM's graceful stop (graceful_stop.py); the connector gives it
        # vLLM's stop flag and budget, inert until then.
        self.graceful_stop = GracefulStop(stop_budget(0, 0), None)

    def _admits_same_step(self, storage) -> bool:
        """Can this engine admit an L3 hit in the step its read is sent
        (l3/same_step.py)? Refuses the option where it cannot."""
        self.check_storage(storage)
        return not self.load_async and not self._groups.hybrid and self.page_states is None

    def check_storage(self, storage) -> None:
        """Raise ValueError if this engine cannot serve ``storage``'s
        options as given (an admin attach or policy update asks first)."""
        if storage is not None:
            check_same_step_policy(storage.same_step_read_wait_ms, storage.prefetch_policy)
        same_step.check_engine(storage, self.load_async,
                               self._groups.hybrid or self.page_states is not None)

    @property
    def events(self) -> EventLog:
        """KV cache events (kv_events.py); the connector turns them on."""
        return self.stores.events

    @events.setter
    def events(self, log: EventLog) -> None:
        self.stores.events = log
        self._l3_ctx.events = log

    # --- the admin side's view (admin/storage_control.py) ----------------

    @property
    def l3(self) -> L3Planner | None:
        """The L3 planner, None while no backend is attached."""
        return self._l3

    def l3_context(self) -> PlannerContext:
        """What an L3 planner built for this scheduler half acts on."""
        return self._l3_ctx

    def attach_l3(self, planner: L3Planner) -> None:
        """Plan L3 lookups, prefetches and backups with ``planner`` from now on."""
        assert self._l3 is None, "an L3 planner is attached already"
        self._l3 = planner

    def detach_l3(self) -> L3Planner | None:
        """Plan nothing more for L3; the planner that was attached (its
        owner closes it once every rank has dropped its client)."""
        planner, self._l3 = self._l3, None
        if planner is not None:
            planner.backups.release_l2()  # exclusive L3's holds would pin L2 forever
        return planner

    def install_commands(self, commands: StepCommands) -> None:
        """Run ``commands`` between steps (the admin side's attach/detach)."""
        self.storage_control = commands

    def num_requests(self) -> int:
        """Requests vLLM has not finished: running, waiting or preempted."""
        return len(self._reqs)

    @property
    def write_policy(self) -> str:
        """The hicache_write_policy in force."""
        return self.stores.write_policy.name

    def set_write_policy(self, name: str) -> None:
        """Switch the write policy (its hit counts start afresh)."""
        if name == self.stores.write_policy.name:
            return
        self.stores.write_policy = WritePolicy(name, hit_counter_slots(self.num_pages),
                                               self.cfg.l2_admission(name), self.block_size)
        self.cfg = dataclasses.replace(self.cfg, hicache_write_policy=WritePolicyName(name))

    def occupancy(self) -> dict[str, int]:
        """L2 pages by state, for the admin API."""
        tree = self.tree
        return {"pages_total": tree.num_pages, "pages_used": tree.num_cached_pages,
                "pages_pinned": tree.num_locked_pages, "pages_free": tree.num_free_pages}

    def live_transfers(self) -> dict[str, int]:
        """Copies the workers have not acknowledged: L3 backups, async loads."""
        return {"backups": self.ops.num_live(OpKind.BACKUP),
                "async_loads": self.ops.num_live(OpKind.ASYNC_LOAD)}

    def stats_snapshot(self) -> dict[str, Any]:
        """The counters since start, by name."""
        return dataclasses.asdict(self.stats)

    # --- lookup and load -------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.serves_hits:
            return 0, False
        node = self._node_hit(request, num_computed_tokens)
        if node is not None:  # loaded as an L2 hit is: in the step unless async
            return node, self.load_async and node > 0
        self.arrivals.start_deferred(self._reqs.get(request.request_id), self.l3)
        if self.l3 is not None and self.l3.must_wait(request.request_id,
                                                     num_computed_tokens // self.block_size):
            return None, False  # per the prefetch policy: ask again later
        pages = self._hit_pages(request, num_computed_tokens)
        state = self._record(request)
        # For update_state_after_alloc, which vLLM calls right after the call
        # that lets the request in (the last call wins).
        state.lookup = Lookup(num_computed_tokens, pages)
        controls = state.controls
        cap = controls.load_block_cap(self.block_size) if controls.loads_l2 else 0
        if pages and cap is not None:
            pages = pages[:cap]
        if self.page_states is not None:
            pages = pages[: self.page_states.usable(pages)]  # a hit ends on a kept state
        start = num_computed_tokens // self.block_size
        l3_pages = self._same_step_pages(request, start, len(pages), cap)
        if not l3_pages and self.l3 is not None and self.l3.same_step_pages(request.request_id):
            return None, False  # its read cannot join this load: wait for it, as before
        state.lookup = state.lookup._replace(l3_pages=l3_pages)
        if not pages and not l3_pages:
            return 0, False
        num_hit = len(pages) + len(l3_pages)  # judged whole, as once it is all in L2
        if not self.load_gate.load_l2(num_computed_tokens, num_hit * self.block_size, num_hit):
            state.declined_blocks = len(pages)  # vLLM recomputes them
            return 0, False
        state.declined_blocks = 0
        if self._inflight.overlaps(request.block_hashes[start : start + len(pages)]):
            return None, False  # ask again once that load has landed
        return (len(pages) + len(l3_pages)) * self.block_size, self.load_async

    def _same_step_pages(self, request: Request, start: int, num_l2: int,
                         cap: int | None) -> tuple[int, ...]:
        """Pages an L3 read sent this step fills right behind the L2 hit
        (l3/same_step.py), within the request's load cap."""
        if self.l3 is None or not self._l3_ctx.same_step:
            return ()
        pages = self.l3.same_step_pages(request.request_id, start + num_l2)
        limit = loadable_block_limit(request.num_tokens, self.block_size) - start - num_l2
        if cap is not None:
            limit = min(limit, cap - num_l2)
        return tuple(pages[: max(0, limit)])

    def _node_hit(self, request: Request, num_computed_tokens: int) -> int | None:
        """A node-tier hit to load into L1 directly (NodeAdmission.hit); None
        when the request has an L2 hit, which keeps the L2 path."""
        if self.node_hits.hits(self.l3) is None or self._hit_pages(request, num_computed_tokens):
            return None
        return self.node_hits.hit(self.l3, self._record(request), num_computed_tokens,
                                  self._step)

    def _hit_pages(self, request: Request, num_computed_tokens: int) -> list[int]:
        start = num_computed_tokens // self.block_size
        limit = loadable_block_limit(request.num_tokens, self.block_size)
        if limit <= start:
            return []
        return self.tree.match(request.block_hashes[:limit]).host_run(start)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        state = self._reqs.get(req_id)
        looked_up = state.lookup if state is not None else None
        if state is None or looked_up is None:
            return  # vLLM's second call for an async load: nothing new
        state.lookup = None
        local = looked_up.num_computed_tokens
        start, num_blocks = local // self.block_size, num_external_tokens // self.block_size
        end = start + num_blocks
        declined = 0
        if num_blocks == 0:
            declined, state.declined_blocks = state.declined_blocks, 0
        l2_end = min(end, start + len(looked_up.pages))  # the rest: a same-step L3 read
        loaded = (num_external_tokens if looked_up.node_blocks
                  else (l2_end - start) * self.block_size)
        self._record_use(request, looked_up.tier, loaded, end, declined)
        if looked_up.l3_pages and l2_end < end:  # read in this step (l3/same_step.py)
            assert self.l3 is not None, req_id
            self._step_same_step.append(
                self.l3.claim_same_step(req_id, blocks.get_block_ids()[0][l2_end:end]))
            # They reach L2 as the read commits: not stored from L1 as well (a
            # copy and a second page each). A failed load lowers
            # num_computed_tokens, and the recomputed blocks are considered again.
            state.num_planned = max(state.num_planned, end)
        stages = hit_tiers.l3_hit_stages(self.l3, req_id, start, end)
        self.access_log.admit(request, local, num_external_tokens, self.l3, self._step,
                              stages, num_external_tokens if looked_up.node_blocks else 0,
                              declined * self.block_size)
        if num_blocks == 0:
            return
        if looked_up.node_blocks:
            self._step_node_loads.append(self.node_hits.admit(
                state, blocks.get_block_ids()[0][start:end], start, end,
                not self.load_async, self.stats))
            return
        if stages is not None:
            self.hit_timer.admitted(req_id, stages, self._step, self.load_async)
        if l2_end > start:
            self._load_l2(request, blocks.get_block_ids(), start, l2_end,
                          looked_up.pages[: l2_end - start])
        self.stats.record_load(num_blocks)
        hit_tiers.record_l2_load(self.stats, self.l3, state, start, end, self.block_size)

    def _record_use(self, request: Request, tier: str, loaded_tokens: int, end: int,
                    declined_blocks: int) -> None:
        """A use of the request's hit up to block ``end``, L1 part included,
        and of the ``declined_blocks`` after it the load gate turned down:
        the gate learns what it loaded and declined, and the whole prefix is
        touched, so one vLLM keeps serving from its own cache does not age
        out of L2 (nor out of exclusive L3's holds)."""
        self.load_gate.record(tier, True, loaded_tokens)
        self.load_gate.record(tier, False, declined_blocks * self.block_size)
        used = end + declined_blocks
        self.tree.touch(request.block_hashes, used, priority=-request.priority)
        if self.l3 is not None:
            self.l3.backups.note_use(request.block_hashes[:used])

    def _load_l2(self, request: Request, group_ids, start: int, end: int,
                 pages: list[int]) -> None:
        """Blocks [start, end) of the request from their L2 ``pages``: a
        pinned LOAD (or ASYNC_LOAD) op and its job."""
        req_id = request.request_id
        # No eviction can run between the lookup and here (see module doc).
        assert len(pages) == end - start, (req_id, len(pages), end - start)
        hashes = request.block_hashes[:end]
        block_ids = group_ids[0][start:end]
        kind = OpKind.ASYNC_LOAD if self.load_async else OpKind.LOAD
        rng = PinnedRange(tuple(hashes), tuple(range(start, end)), tuple(pages))
        op = self.ops.open(kind, self._step, [rng], req_id, block_ids)
        job = LoadJob(req_id, self._groups.load_copy(group_ids, start, pages))
        if self.load_async:
            self._step_async_loads.append(job)
            self._inflight.start(req_id, op, hashes[start:])
        else:
            self._step_loads.append(job)

    def hit_tiers(self, req_id: str, num_tokens: int) -> dict[str, int]:
        """``num_tokens`` of the request's last hit, by tier (non-zero only)."""
        return hit_tiers.take(self._reqs.get(req_id), num_tokens)

    # --- per step --------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HiCacheMetadata:
        if scheduler_output.total_num_scheduled_tokens == 0 and self._awaits_io():
            self._space_empty_step()
        # Building step N acknowledges step N-1 (see page_ops.py).
        self.ops.close_step(self._step)
        track_scheduled(self._reqs, scheduler_output)
        stop = self.graceful_stop
        stop.poll(self.l3)
        if stop.first_step() and self.l3 is not None:
            # Under write-back, what only L1 holds goes to L2 in this step,
            # then to L3 (graceful_stop.py).
            stop.count_from_l1(self.write_backs.queue_l1_only())
        self.write_backs.plan()
        evict = self.write_backs.take()
        store_pairs = self.stores.advance(self._reqs, scheduler_output, self._step)
        meta = HiCacheMetadata(
            evict_stores=merge_copies([BlockPage(c.block_id, c.page) for c in evict]),
            loads=self._step_loads,
            async_loads=self._step_async_loads,
            stores=merge_copies(store_pairs),
            node_loads=self._step_node_loads,
            same_step_loads=self._step_same_step,
        )
        self._step_loads, self._step_async_loads, self._step_node_loads = [], [], []
        self._step_same_step = []
        stored = self.stores.take_stored_ranges()
        if self.l3 is not None:
            self.l3.begin_step()  # the breaker's answer, for this step
        backs_up = self.l3 is not None  # before a command attaches or detaches L3
        if self.storage_control is not None:  # admin commands run here, between steps
            meta.storage_command = self.storage_control.on_step(
                len(scheduler_output.num_scheduled_tokens))
        if self.l3 is not None:
            self.graceful_stop.poll(self.l3)
            meta.backups = self.l3.plan_backups(stored if backs_up else [], self._step,
                                                self.graceful_stop.pick(self.l3))
            meta.prefetches = self.l3.plan_prefetches()
            meta.prefetch_wait_s = self.l3.report_wait_s()
            meta.stop_flush = self.graceful_stop.flushing
        # Also a replaced backend's last backups; paused while the breaker is not closed.
        if self.storage_control is not None and (self.l3 is None or self.l3.usable):
            meta.backups += self.storage_control.plan_backfill(self._step)
        self._step += 1
        in_step_copies = meta.loads or meta.evict_stores or meta.same_step_loads or any(
            job.in_step for job in meta.node_loads)
        self.load_gate.step_planned(scheduler_output, bool(in_step_copies))
        return meta

    def _space_empty_step(self) -> None:
        """Sleep what is left of ``EMPTY_STEP_PAUSE_S`` since the last empty
        step waiting on I/O began (nothing where vLLM's own pause covered it)."""
        short_s = self._last_empty_step + EMPTY_STEP_PAUSE_S - time.monotonic()
        if short_s > 0:
            time.sleep(short_s)
        self._last_empty_step = time.monotonic()

    # --- completions, lifecycle ------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.load_gate.step_done(output.kv_connector_stats)
        self.failed_copies.drop_failed_requests(output)
        for req_id in output.finished_recving or ():
            op = self._inflight.finish(req_id)
            if op is not None:
                self.ops.close(op)
        self.hit_timer.step_done(output.finished_recving or ())
        meta = output.kv_connector_worker_meta
        if meta is not None and meta.node_tier_counts:
            self.node_counts.on_report(meta.node_tier_counts)
        if self.l3 is not None and meta is not None:
            self.l3.on_worker_meta(meta)
        if self.storage_control is not None and meta is not None:
            self.storage_control.on_worker_meta(meta)  # a replaced backend's late reports
            if meta.storage_acks:
                self.storage_control.on_acks(meta.storage_acks)
        self.failed_copies.drop_failed_copies(output, meta)

    def _record(self, request: Request) -> ReqState:
        """The request's record; the one place one is made (vLLM announces
        each request with on_new_request before it looks it up)."""
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = ReqState(request)
        return state

    def on_new_request(self, request: Request) -> None:
        state = self._record(request)
        self.access_log.arrive(request, self._step)
        self.arrivals.arrive(state, self.l3 if self.serves_hits else None, self._step)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, str] | None]:
        # An in-flight async load keeps its pins until the worker reports it:
        # vLLM itself delays freeing the blocks of such a request.
        req_id = request.request_id
        state = self._reqs.pop(req_id, None)  # the one place a record is dropped
        self.hit_timer.forget(req_id)
        self.access_log.finish(request, len(block_ids), self._step)
        if self.l3 is not None:
            self.l3.forget(req_id)
        error = state.param_error if state is not None else None
        return False, ({"hicache_error": error} if error is not None else None)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, str] | None]:
        """vLLM's hook for hybrid-allocator connectors: one block table per group."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def bind_gpu_block_pool(self, block_pool: BlockPool) -> None:
        self.arrivals.bind(block_pool)
        self._groups.bind(block_pool)
        self.failed_copies.bind(block_pool)
        if self.cfg.hicache_write_policy == WritePolicyName.WRITE_BACK:
            self.write_backs.watch(block_pool)

    def _on_l2_evict(self, hashes: list[bytes]) -> None:
        self.stats.record_evict(len(hashes))
        self.events.removed(MEDIUM_L2, hashes)
        self.write_backs.forget(hashes)

    def _awaits_io(self) -> bool:
        """Work only the workers or the L3 threads can finish: backups,
        async loads, L3 lookups and prefetches."""
        return bool(self.ops.num_live(OpKind.ASYNC_LOAD) or self.ops.num_live(OpKind.BACKUP)
                    or (self.l3 is not None and self.l3.awaits_io()))

    def has_pending_work(self) -> bool:
        """Operations only the workers can finish (backups, async loads, L3
        prefetches): vLLM keeps stepping while this is True, so their acks
        and pins move on while no request runs. A store that makes no
        progress for ``STALLED_WORK_S`` (stall_watch.py) stops keeping an idle engine busy
        (its acks then ride on the next request's steps), except during a
        graceful stop's flush time, which has a deadline of its own: a slow
        store's backups must not end the stop early. Admin commands
        (admin/storage_control.py) keep it stepping too, each bounded by its own deadlines.
        During a graceful stop, pages only L2 holds keep it stepping too, until
        the stop's flush time is up; after that nothing does (graceful_stop.py)."""
        stop = self.graceful_stop
        stop.poll(self.l3)
        return stop.keeps_engine_busy(self._has_pending_work() or stop.has_l2_only(self.l3))

    def _has_pending_work(self) -> bool:
        if self.storage_control is not None and self.storage_control.has_work():
            return True
        pending = self._awaits_io()
        progressing = self.stall_watch.keeps_stepping(pending, len(self.ops))
        return pending and (self.graceful_stop.flushing or progressing)

    # --- metrics and events ------------------------------------------------

    def stats_report(self) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]]]:
        """Counter increments since the last report, the gauges that
        changed (stats.py) and the histograms' observations, for
        get_kv_connector_stats."""
        tree = self.tree
        gauges = {
            key("l2_pages_used"): self.num_pages - tree.num_free_pages,
            key("l2_pages_pinned"): tree.num_locked_pages,
            key("l2_pages_total"): self.num_pages,
            **self.load_gate.gauge_samples(),
        }
        if self.l3 is not None:
            gauges[key("backup_backlog_blocks")] = self.l3.backups.backlog.num_blocks
            gauges[key("l3_breaker_state")] = self.l3.breaker_gauge()
        counters, changed = self._report.take(
            self.stats, self.l3, gauges, {key("kv_events_dropped"): self.events.dropped,
                                          **self.load_gate.counter_samples(),
                                          **self.node_counts.own_samples(
                                              self.l3.backend if self.l3 is not None else None)})
        return counters, changed, self.hit_timer.take()

    def take_events(self) -> list[Any]:
        return self.events.take()

    def check_integrity(self) -> None:
        """Raise RuntimeError naming every broken invariant of the scheduler
        half (tests and debugging; O(L2 size))."""
        self.tree.check_integrity()
        problems = self.ops.check()
        if self.l3 is not None:
            problems += self.l3.check()
        async_ops = {op.req_id for op in self.ops.live(OpKind.ASYNC_LOAD)}
        if async_ops != self._inflight.req_ids():
            problems.append(f"async loads in flight {sorted(self._inflight.req_ids())} "
                            f"!= pinned async loads {sorted(async_ops, key=str)}")
        prefetching = self.l3.prefetch_pages() if self.l3 is not None else set()
        if self.storage_control is not None:
            prefetching |= self.storage_control.scratch_pages()  # an attach's canary pages
        allocated = self.tree.allocated_pages()
        if prefetching != allocated:
            problems.append(f"pages allocated but not indexed {sorted(allocated)} are not the "
                            f"pages of open prefetches {sorted(prefetching)}")
        if problems:
            raise RuntimeError("HiCache scheduler integrity: " + "; ".join(problems[:8]))

    def shutdown(self) -> None:
        self.access_log.close()
        line = self.graceful_stop.final_line(self.l3)
        if line is not None:
            logger.info("%s", line)
        if self.l3 is not None:
            self.l3.close()

    def reset_cache(self) -> bool:
        """Drop L2 (``reset_prefix_cache(reset_connector=True)``); pinned
        pages stay until their operations end."""
        if self.l3 is not None:
            self.l3.backups.release_l2()  # held pages must go with the rest
        self.events.removed(MEDIUM_L2, self.tree.clear())
        self.stores.write_policy.clear()
        self.write_backs.clear_l2()
        return True
