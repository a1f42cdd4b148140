"""Scheduler half: owns the HiRadixTree and every L2 decision.

Runs in EngineCore. It never touches KV bytes and never waits on I/O; it
emits per-step operations (``HiCacheMetadata``) that the workers execute.

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
when it is pinned. A copy the workers report as failed takes its page (and
what hangs below it) out of the index, so it is never a hit again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, Protocol

from vllm_hicache.common.events import MEDIUM_L2, EventLog
from vllm_hicache.common.jobs import (
    BackupJob,
    BlockPage,
    LoadJob,
    StorageCommand,
    merge_copies,
)
from vllm_hicache.common.page_ops import OpKind, PageOp, PageOps, PinnedRange
from vllm_hicache.common.page_states import PageStates
from vllm_hicache.common.stats import HiCacheStats, SchedulerReport, key
from vllm_hicache.config import HiCacheConfig, LoadMode
from vllm_hicache.connector.geometry import KVGeometry, host_num_pages
from vllm_hicache.connector.metadata import HiCacheMetadata
from vllm_hicache.connector.vllm_compat import drop_l1_blocks, l1_has_block
from vllm_hicache.host.memory import check_fits
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import loadable_block_limit
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.policy import make_eviction_policy
from vllm_hicache.policy.write import WritePolicy, WritePolicyName, hit_counter_slots
from vllm_hicache.scheduler.access_log import open_access_log
from vllm_hicache.scheduler.group_blocks import GroupBlocks
from vllm_hicache.scheduler.inflight import InflightLoads
from vllm_hicache.scheduler.load_gate import LoadGate
from vllm_hicache.scheduler.pd import loads_hits
from vllm_hicache.scheduler.request_params import (
    DEFAULT_CONTROLS,
    NO_HICACHE,
    RequestControls,
    parse_request_params,
)
from vllm_hicache.scheduler.request_state import Lookup, ReqState, track_scheduled
from vllm_hicache.scheduler.store_planner import L2StorePlanner
from vllm_hicache.scheduler.write_back import WriteBackCopy, WriteBackWatcher

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# Warnings about rejected kv_transfer_params, at most one per this many seconds.
_PARAM_WARN_INTERVAL_S = 60.0
# An idle engine keeps stepping for pending L3/async work at most this long
# without any operation finishing.
STALLED_WORK_S = 30.0
# A step that schedules nothing while requests wait on L3 or async loads
# pauses this long: vLLM's loop would otherwise spin about a thousand empty
# steps per wait, on the cores the I/O threads need. Costs at most this much
# latency per completion.
EMPTY_STEP_PAUSE_S = 0.001


class StepCommands(Protocol):
    """Work the admin side runs on the engine loop, between steps
    (admin/storage_control.py): the scheduler half calls it, never the
    other way round."""

    def on_step(self, num_running: int) -> StorageCommand | None: ...

    def plan_backfill(self, step: int) -> list[BackupJob]: ...

    def on_acks(self, acks: Mapping[int, Mapping[int, str]]) -> None: ...

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
        # The one record per request (request_state.py): made by _record,
        # dropped by request_finished.
        self._reqs: dict[str, ReqState] = {}
        self.ops = PageOps(self.tree)
        # The step being scheduled; build_connector_meta ends it.
        self._step = 0
        # has_pending_work: live-op count last seen, and since when.
        self._pending_ops_seen = 0
        self._pending_since = time.monotonic()
        self._step_loads: list[LoadJob] = []
        self._step_async_loads: list[LoadJob] = []
        self._inflight = InflightLoads()
        self._evict_copies: list[WriteBackCopy] = []
        # STORE ops of the write-backs in _evict_copies, not yet emitted.
        self._evict_ops: list[PageOp] = []
        self._block_pool: BlockPool | None = None
        # The engine's start line (connector.start_line) reports the sizes.
        # Models with a state group: which pages hold a usable state.
        self.page_states = PageStates(self.num_pages) if geom.mamba_groups else None
        self.stores = L2StorePlanner(
            self.tree, self.ops, self._groups,
            WritePolicy(cfg.hicache_write_policy, hit_counter_slots(self.num_pages)), self.stats,
            self.page_states, self.block_size, EventLog(False, self.block_size))
        # hicache_load_decision (load_gate.py): its estimators.
        self.load_gate = LoadGate(cfg.hicache_load_decision, geom.bytes_per_block)
        # What the L3 planner acts on (its own and a runtime attach's).
        self._l3_ctx = PlannerContext(self.tree, self.ops, self.stores.alloc_protecting,
                                      self.load_gate, self.stores.events)
        self._l3: L3Planner | None = (l3_factory(self.num_pages, self.page_states, self._l3_ctx)
                                      if l3_factory else None)
        # Runtime attach/detach of L3 (admin API): install_commands.
        self.storage_control: StepCommands | None = None
        self._report = SchedulerReport()
        self._param_warned_at = -_PARAM_WARN_INTERVAL_S
        # hicache_access_log, for the capacity planner (a no-op when off).
        self.access_log = open_access_log(cfg, geom, self.num_pages, local_ranks)

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
        self.stores.write_policy = WritePolicy(name, hit_counter_slots(self.num_pages))
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
        if self.l3 is not None and self.l3.must_wait(request.request_id):
            return None, False  # per the prefetch policy: ask again later
        pages = self._hit_pages(request, num_computed_tokens)
        state = self._record(request)
        # For update_state_after_alloc, which vLLM calls right after the call
        # that lets the request in (the last call wins).
        state.lookup = Lookup(num_computed_tokens, pages)
        controls = state.controls
        if pages:
            cap = controls.load_block_cap(self.block_size) if controls.loads_l2 else 0
            if cap is not None:
                pages = pages[:cap]
        if self.page_states is not None:
            pages = pages[: self.page_states.usable(pages)]  # a hit ends on a kept state
        if not pages:
            return 0, False
        if not self.load_gate.load_l2(num_computed_tokens, len(pages) * self.block_size,
                                      len(pages)):
            state.declined_blocks = len(pages)  # vLLM recomputes them
            return 0, False
        state.declined_blocks = 0
        start = num_computed_tokens // self.block_size
        if self._inflight.overlaps(request.block_hashes[start : start + len(pages)]):
            return None, False  # ask again once that load has landed
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
        self.load_gate.record("L2", True, num_external_tokens)
        self.load_gate.record("L2", False, declined * self.block_size)
        # A use of the whole hit, L1 part (and a declined L2 hit) included: a
        # prefix vLLM keeps serving from its own cache must not age out of L2.
        self.tree.touch(request.block_hashes, end + declined, priority=-request.priority)
        if self.l3 is not None:
            self.l3.note_use(request.block_hashes[: end + declined])
        self.access_log.admit(request, local, num_external_tokens, self.l3, self._step)
        if num_blocks == 0:
            return
        pages = looked_up.pages[:num_blocks]
        # No eviction can run between the lookup and here (see module doc).
        assert len(pages) == num_blocks, (req_id, len(pages), num_blocks)
        hashes = request.block_hashes[:end]
        group_ids = blocks.get_block_ids()
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
        self.stats.record_load(num_blocks)
        self._record_hit_tiers(state, start, end)

    def _record_hit_tiers(self, state: ReqState, start: int, end: int) -> None:
        """Split the hit [start, end) into what was in L2 and what this
        request's own L3 prefetch brought in."""
        l3_blocks = 0
        fetched = (self.l3.prefetched_range(state.request.request_id)
                   if self.l3 is not None else None)
        if fetched is not None:
            l3_blocks = max(0, min(end, fetched[1]) - max(start, fetched[0]))
        tiers = ((end - start - l3_blocks) * self.block_size, l3_blocks * self.block_size)
        self.stats.record_hit_tokens(*tiers)
        state.hit_tokens_by_tier = tiers

    def hit_tiers(self, req_id: str, num_tokens: int) -> dict[str, int]:
        """``num_tokens`` of the request's last hit, by tier (non-zero only)."""
        state = self._reqs.get(req_id)
        tiers = state.hit_tokens_by_tier if state is not None else None
        if state is not None:
            state.hit_tokens_by_tier = None  # asked once per admission
        l2, l3 = tiers if tiers is not None else (num_tokens, 0)
        if l2 + l3 != num_tokens:
            l2, l3 = num_tokens, 0
        return {tier: n for tier, n in (("L2", l2), ("L3", l3)) if n}

    # --- per step --------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HiCacheMetadata:
        if scheduler_output.total_num_scheduled_tokens == 0 and self._awaits_io():
            time.sleep(EMPTY_STEP_PAUSE_S)
        # Building step N acknowledges step N-1 (see page_ops.py).
        self.ops.close_step(self._step)
        track_scheduled(self._reqs, scheduler_output)
        self._plan_write_backs()
        evict, self._evict_copies, self._evict_ops = self._evict_copies, [], []
        store_pairs = self.stores.advance(self._reqs, scheduler_output, self._step)
        meta = HiCacheMetadata(
            evict_stores=merge_copies([BlockPage(c.block_id, c.page) for c in evict]),
            loads=self._step_loads,
            async_loads=self._step_async_loads,
            stores=merge_copies(store_pairs),
        )
        self._step_loads, self._step_async_loads = [], []
        self.stats.record_store(len(evict))  # store_range counts its pages
        stored = self.stores.take_stored_ranges()
        backs_up = self.l3 is not None  # before a command attaches or detaches L3
        if self.storage_control is not None:  # admin commands run here, between steps
            meta.storage_command = self.storage_control.on_step(
                len(scheduler_output.num_scheduled_tokens))
        if self.l3 is not None:
            meta.backups = self.l3.plan_backups(stored if backs_up else [], self._step)
            if self.storage_control is not None:
                meta.backups += self.storage_control.plan_backfill(self._step)
            meta.prefetches = self.l3.plan_prefetches()
        self._step += 1
        self.load_gate.step_planned(scheduler_output, bool(meta.loads or meta.evict_stores))
        return meta

    # --- completions, lifecycle ------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.load_gate.step_done(output.kv_connector_stats)
        failed_reqs = getattr(output, "failed_recving", None)
        if failed_reqs:
            self._drop_failed_loads(failed_reqs)
        for req_id in output.finished_recving or ():
            op = self._inflight.finish(req_id)
            if op is not None:
                self.ops.close(op)
        meta = output.kv_connector_worker_meta
        if self.l3 is not None and meta is not None:
            self.l3.on_worker_meta(meta)
        if self.storage_control is not None and meta is not None and meta.storage_acks:
            self.storage_control.on_acks(meta.storage_acks)
        failed_pages = meta.failed_store_pages if meta is not None else set()
        if output.invalid_block_ids or failed_pages:
            self._drop_failed(set(output.invalid_block_ids or ()), failed_pages)

    def _drop_failed(self, l1_blocks: set[int], pages: set[int]) -> None:
        """Copies failed: the pages involved must never be hits again (a
        failed load means the page is unreadable, a failed store that it
        holds garbage); vLLM recomputes the blocks."""
        self.stats.record_load_errors(len(l1_blocks))
        for chain in list(self.ops.recent_uses(l1_blocks=l1_blocks, pages=pages)):
            self.stats.record_invalidated(self.tree.invalidate(chain, len(chain) - 1))
        if l1_blocks and self._block_pool is not None:
            # Under kv_load_failure_policy=recompute vLLM keeps the failed
            # blocks (and those computed on top of them) in its prefix cache
            # until the request recomputes them: any request scheduled
            # meanwhile would hit them, and we would store what it read.
            drop_l1_blocks(self._block_pool, self._blocks_from_first_failure(l1_blocks))

    def _drop_failed_loads(self, req_ids: Set[str]) -> None:
        """Async loads failed as a whole (hybrid models report failures per
        request): their pages must never be hits again; vLLM recomputes."""
        for op in self.ops.live(OpKind.ASYNC_LOAD):
            if op.req_id in req_ids:
                rng = op.ranges[0]
                self.stats.record_load_errors(len(rng.blocks))
                first = rng.blocks[0]
                self.stats.record_invalidated(self.tree.invalidate(rng.chain[: first + 1], first))

    def _blocks_from_first_failure(self, l1_blocks: set[int]) -> set[int]:
        """The failed blocks, and every later block of the requests that own
        them (computed this step over the missing KV)."""
        doomed = set(l1_blocks)
        for state in self._reqs.values():
            ids = state.block_ids
            first = next((i for i, b in enumerate(ids) if b in l1_blocks), None)
            if first is not None:
                doomed.update(ids[first:])
        return doomed

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
        controls = state.controls = self._read_controls(request, state)
        if self.l3 is not None and controls.looks_up_l3 and self.serves_hits:
            limit = loadable_block_limit(request.num_tokens, self.block_size)
            chain = tuple(request.block_hashes[:limit])
            resident = self._resident_blocks(chain)
            cap = controls.load_block_cap(self.block_size)
            if cap is not None:
                chain = chain[: resident + cap]
            self.l3.start_lookup(request.request_id, chain, resident)

    def _read_controls(self, request: Request, state: ReqState) -> RequestControls:
        """The request's kv_transfer_params controls. Bad ones never fail
        the engine: the request runs without HiCache, the reason goes back
        in its output's kv_transfer_params (``hicache_error``) and the log."""
        params = request.kv_transfer_params
        if not params:
            return DEFAULT_CONTROLS
        try:
            return parse_request_params(params)
        except ValueError as exc:
            self.stats.record_param_error()
            state.param_error = str(exc)
            now = time.monotonic()
            if now - self._param_warned_at >= _PARAM_WARN_INTERVAL_S:
                self._param_warned_at = now
                logger.warning("HiCache: request %s served without HiCache: %s "
                               "(%d such requests so far; logged at most once a minute)",
                               request.request_id, exc, self.stats.request_param_errors)
            return NO_HICACHE

    def _resident_blocks(self, chain: tuple[bytes, ...]) -> int:
        """Leading blocks already in L2 or in vLLM's own cache (L1)."""
        pages = self.tree.match(chain).pages
        pool = self._block_pool
        i = 0
        while i < len(chain) and (
            (i < len(pages) and pages[i] is not None)
            or (pool is not None and l1_has_block(pool, chain[i]))
        ):
            i += 1
        return i

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, str] | None]:
        # An in-flight async load keeps its pins until the worker reports it:
        # vLLM itself delays freeing the blocks of such a request.
        req_id = request.request_id
        state = self._reqs.pop(req_id, None)  # the one place a record is dropped
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
        self._block_pool = block_pool
        self._groups.bind(block_pool)
        if self.cfg.hicache_write_policy == WritePolicyName.WRITE_BACK:
            self.stores.write_back = WriteBackWatcher(
                block_pool, 2 * block_pool.num_gpu_blocks, on_reset=self._plan_write_backs
            )

    def _plan_write_backs(self) -> None:
        write_back = self.stores.write_back
        if write_back is not None:
            self._evict_copies += write_back.plan(
                self.tree, self._alloc_write_back, self._pin_write_back)

    def _alloc_write_back(self, chain: Sequence[bytes], num_matched: int,
                          num_pages: int) -> list[int] | None:
        pages = self.stores.alloc_protecting(chain, num_matched, num_pages)
        if pages is None:  # every page pinned: this block is simply not kept
            self.stats.record_store_skipped(num_pages)
        return pages

    def _pin_write_back(self, chain: Sequence[bytes], page: int) -> None:
        self._evict_ops.append(self.stores.insert_pinned(
            OpKind.WRITE_BACK, chain, [len(chain) - 1], [page], self._step))

    def _on_l2_evict(self, hashes: list[bytes]) -> None:
        self.stats.record_evict(len(hashes))
        self.events.removed(MEDIUM_L2, hashes)
        if self.stores.write_back is not None:
            self.stores.write_back.forget(hashes)

    def _awaits_io(self) -> bool:
        """Work only the workers or the L3 threads can finish: backups,
        async loads, L3 lookups and prefetches."""
        return bool(self.ops.num_live(OpKind.ASYNC_LOAD) or self.ops.num_live(OpKind.BACKUP)
                    or (self.l3 is not None and self.l3.awaits_io()))

    def has_pending_work(self) -> bool:
        """Operations only the workers can finish (backups, async loads, L3
        prefetches): vLLM keeps stepping while this is True, so their acks
        and pins move on while no request runs. A store that makes no
        progress for ``STALLED_WORK_S`` stops keeping an idle engine busy
        (its acks then ride on the next request's steps). Admin commands
        (admin/storage_control.py) keep it stepping too, each bounded by its own deadlines."""
        if self.storage_control is not None and self.storage_control.has_work():
            return True
        pending = self._awaits_io()
        now = time.monotonic()
        if not pending or len(self.ops) != self._pending_ops_seen:
            self._pending_ops_seen = len(self.ops)
            self._pending_since = now
        return pending and now - self._pending_since < STALLED_WORK_S

    # --- metrics and events ------------------------------------------------

    def stats_report(self) -> tuple[dict[str, float], dict[str, float]]:
        """Counter increments since the last report and the gauges that
        changed (stats.py), for get_kv_connector_stats."""
        tree = self.tree
        gauges = {
            key("l2_pages_used"): self.num_pages - tree.num_free_pages,
            key("l2_pages_pinned"): tree.num_locked_pages,
            key("l2_pages_total"): self.num_pages,
            **self.load_gate.gauge_samples(),
        }
        if self.l3 is not None:
            gauges[key("backup_backlog_blocks")] = self.l3.backlog.num_blocks
        return self._report.take(self.stats, self.l3, gauges,
                                 {key("kv_events_dropped"): self.events.dropped,
                                  **self.load_gate.counter_samples()})

    def take_events(self) -> list[Any]:
        return self.events.take()

    def check_integrity(self) -> None:
        """Raise RuntimeError naming every broken invariant of the scheduler
        half (tests and debugging; O(L2 size))."""
        self.tree.check_integrity()
        problems = self.ops.check()
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
        if self.l3 is not None:
            self.l3.close()

    def reset_cache(self) -> bool:
        """Drop L2 (``reset_prefix_cache(reset_connector=True)``); pinned
        pages stay until their operations end."""
        self.events.removed(MEDIUM_L2, self.tree.clear())
        self.stores.write_policy.clear()
        if self.stores.write_back is not None:
            self.stores.write_back.clear_l2()
        return True
