"""Runtime attach and detach of the L3 tier: the engine side of the admin API.

Where commands run. The admin HTTP server (admin/api.py) runs on a thread of
the EngineCore process, but the scheduler half's state belongs to the engine
loop. So ``StorageControl.submit`` queues a command and wakes the loop
(``vllm_compat.engine_loop_waker``); while a command is queued or in progress
``has_pending_push_work`` is true, so vLLM steps (an empty step when no
request runs), and the command runs in ``build_connector_meta``
(``on_step``), between steps, like everything else of the scheduler half.
The HTTP thread waits on the command's future. Every answer is
``(HTTP status, JSON body)``.

Idle rule (attach and detach): no request known to the scheduler half
(running, waiting or preempted); refused with 409 and the counts otherwise.
Transfers still in flight (backups, prefetches, lookups, async loads, a
clear) are waited for, up to ``DRAIN_TIMEOUT_S`` with the engine stepping,
then refused with 409 and their counts. A detach stops the backfill (below)
from planning more while it waits.

Attach:

1. the scheduler half checks (block hashes shareable, no other backend),
   builds its planner (backend client, key namespaces) and allocates two
   free L2 pages for the workers' canary (l3_canary: L2 is in use now);
2. that step's metadata carries a StorageCommand that every rank runs
   before anything else of the step: it builds its StorageIO (backend
   client, canary on the two pages);
3. every rank acknowledges in its worker metadata (merged over ranks). When
   all have: success installs the planner as ``sched.l3`` and queues L2's
   content for backup (``Backfill``); any failure sends a detach command that
   undoes the ranks that succeeded, closes the planner, and the answer names
   each failed rank's error. The planner is installed only once every rank
   has its client and removed before any rank drops it, so nothing is ever
   planned for a rank without one.

Detach removes ``sched.l3`` at once (nothing more is planned), every rank
closes its client, and the planner is closed when all have acknowledged.
Nothing stored is deleted; detaching a detached tier succeeds.

Re-attaching the attached backend updates its prefetch policy and knobs and
the write policy in place (no idle wait for transfers: nothing is rebuilt);
different backend options, another backend, a different storage_secret are
refused (409): detach first.

Backfill: what L2 held before the attach is backed up in the background
(l3/backfill.py), at most ``BACKFILL_PAGES_PER_STEP`` pages a step and
``BACKFILL_MAX_INFLIGHT_PAGES`` unacknowledged, as ordinary BACKUP ops
(pinned until every rank acknowledged). The worker side of a command is
l3/attach_worker.py.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_hicache import io_threads
from vllm_hicache.common.jobs import BackupJob, StorageCommand
from vllm_hicache.l3.backfill import Backfill
from vllm_hicache.policy.write import WritePolicyName
from vllm_hicache.redaction import REDACTED, redacted, shown_error
from vllm_hicache.storage_config import StorageConfig

if TYPE_CHECKING:
    from vllm_hicache.config import HiCacheConfig
    from vllm_hicache.l3.planner import L3Planner
    from vllm_hicache.scheduler.scheduler import HiCacheScheduler

logger = logging.getLogger(__name__)

# How long an attach or detach waits for transfers in flight to finish.
DRAIN_TIMEOUT_S = 10.0
# How long the scheduler half waits for every rank's acknowledgement. Acks
# come with the output of the step that carried the command, so this only
# bounds a lost one.
ACK_TIMEOUT_S = 120.0
BACKFILL_PAGES_PER_STEP = 256
BACKFILL_MAX_INFLIGHT_PAGES = 1024

@dataclass(frozen=True)
class AttachSpec:
    """A validated attach request (admin_api.parse_attach)."""

    backend: str
    # The hicache_storage_* keys, as kv_connector_extra_config would hold
    # them: what every worker parses. May hold a secret.
    storage_keys: Mapping[str, Any] = field(repr=False)
    storage: StorageConfig = field(repr=False)
    prefetch_policy_given: bool = False
    extra_config_given: bool = False
    write_policy: str | None = None


@dataclass(eq=False)
class _Command:
    kind: str  # "get" | "attach" | "detach" | "clear"
    spec: AttachSpec | None
    future: Future
    taken: bool = False
    drain_deadline: float | None = None


@dataclass(eq=False)
class _Txn:
    """A command sent to the workers, waiting for every rank's ack."""

    kind: str  # "attach" | "detach" | "rollback"
    cmd: _Command
    cmd_id: int
    deadline: float
    planner: L3Planner | None = None
    write_policy: str | None = None
    canary_pages: list[int] = field(default_factory=list)
    acks: dict[int, str] = field(default_factory=dict)
    # rollback: the attach's failures, reported when the rollback ends.
    errors: dict[int, str] = field(default_factory=dict)


def _answer(cmd: _Command, status: int, body: dict[str, Any]) -> None:
    try:
        cmd.future.set_result((status, body))
    except InvalidStateError:
        pass  # withdrawn (cancelled) by its HTTP handler meanwhile


class StorageControl:
    """The scheduler half's admin state machine (see module doc)."""

    def __init__(
        self,
        sched: HiCacheScheduler,
        build_planner: Callable[[HiCacheConfig], L3Planner],
        world_size: int,
        check_attachable: Callable[[], None] = lambda: None,
        waker: Callable[[], None] | None = None,
    ) -> None:
        self._sched = sched
        self._build_planner = build_planner
        self.world_size = world_size
        self._check_attachable = check_attachable
        self.waker = waker
        self.drain_timeout_s = DRAIN_TIMEOUT_S
        self.ack_timeout_s = ACK_TIMEOUT_S
        self._lock = threading.Lock()  # guards _queue and _Command.taken
        self._queue: collections.deque[_Command] = collections.deque()
        self._txn: _Txn | None = None
        self._outbox: StorageCommand | None = None
        self._cmd_ids = itertools.count(1)
        self._backfill: Backfill | None = None
        self._backfill_paused = False
        self._clearing: Future | None = None
        # The last backfill's report, once it is done (GET).
        self._backfill_done: dict[str, Any] | None = None
        self._closed = False

    # --- HTTP thread ---------------------------------------------------------

    def submit(self, kind: str, spec: AttachSpec | None = None) -> Future:
        """Queue a command for the engine loop; its future gets the answer."""
        cmd = _Command(kind, spec, Future())
        with self._lock:
            if self._closed:
                _answer(cmd, 503, {"error": "the engine is shutting down"})
                return cmd.future
            self._queue.append(cmd)
        if self.waker is not None:
            try:
                self.waker()
            except Exception:  # the loop then runs it on its next step
                logger.debug("HiCache admin: waking the engine loop failed", exc_info=True)
        return cmd.future

    def withdraw(self, future: Future) -> bool:
        """Drop a command the engine has not started; False if it has."""
        with self._lock:
            for cmd in self._queue:
                if cmd.future is future and not cmd.taken:
                    self._queue.remove(cmd)
                    future.cancel()
                    return True
        return False

    def close(self) -> None:
        """Engine shutdown: answer whatever is still open."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), collections.deque()
        txn, self._txn = self._txn, None
        if txn is not None and txn.kind == "attach":
            _close_quietly(txn.planner)  # never installed: nobody else closes it
        for cmd in queued + ([txn.cmd] if txn is not None else []):
            _answer(cmd, 503, {"error": "the engine is shutting down"})

    # --- engine loop -----------------------------------------------------------

    def has_work(self) -> bool:
        """Keeps vLLM stepping (has_pending_push_work) while true."""
        if self._queue or self._txn is not None or self._outbox is not None:
            return True
        planner = self._sched.l3
        return (self._backfill is not None and planner is not None
                and not self._backfill_paused and self._backfill.can_plan(planner))

    def scratch_pages(self) -> set[int]:
        """L2 pages allocated for an attach's canary (integrity checks)."""
        return set(self._txn.canary_pages) if self._txn is not None else set()

    def on_step(self, num_running: int) -> StorageCommand | None:
        """Run queued commands; called by build_connector_meta. Returns the
        command this step's metadata must carry to every rank, if any."""
        now = time.monotonic()
        if self._txn is not None and now > self._txn.deadline:
            self._ack_timeout(self._txn)
        if self._outbox is not None:
            out, self._outbox = self._outbox, None
            return out
        while True:
            with self._lock:
                cmd = self._queue[0] if self._queue else None
                if cmd is not None:
                    cmd.taken = True
            if cmd is None:
                return None
            verdict = None
            if cmd.kind in ("attach", "detach"):
                if self._txn is not None:
                    return None  # one at a time: after the open one ends
                verdict = self._idle_verdict(cmd, num_running, now)
                if verdict == "wait":
                    return None
            self._pop(cmd)
            if cmd.kind == "get":
                _answer(cmd, 200, self.snapshot())
            elif cmd.kind == "clear":
                self._clear(cmd)
            elif verdict is not None:
                self._backfill_paused = False
                _answer(cmd, 409, verdict)
            else:
                self._backfill_paused = False
                begun = self._begin(cmd, now)
                if begun is not None:
                    return begun

    def _pop(self, cmd: _Command) -> None:
        with self._lock:
            self._queue.remove(cmd)

    def _idle_verdict(self, cmd: _Command, num_running: int, now: float):
        """None: go; "wait": transfers are draining; else the 409 body."""
        sched = self._sched
        num_requests = sched.num_requests()  # every request vLLM has not finished
        if num_requests:
            running = min(num_running, num_requests)
            return {"error": f"{cmd.kind} refused: the engine is not idle ({running} running, "
                             f"{num_requests - running} waiting requests); retry when idle",
                    "running": running, "waiting": num_requests - running}
        if cmd.kind == "attach" and sched.l3 is not None:
            return None  # a policy update, or refused in _begin: nothing to drain
        if cmd.kind == "detach" and sched.l3 is None:
            return None
        transfers = self.transfers()
        if not any(transfers.values()):
            return None
        if cmd.drain_deadline is None:
            cmd.drain_deadline = now + self.drain_timeout_s
            self._backfill_paused = cmd.kind == "detach"
        if now < cmd.drain_deadline:
            return "wait"
        return {"error": f"{cmd.kind} refused: transfers still in flight after "
                         f"{self.drain_timeout_s:g} s; retry later",
                "running": 0, "waiting": 0, "transfers": transfers}

    def transfers(self) -> dict[str, int]:
        sched = self._sched
        counts = {**sched.live_transfers(), "prefetches": 0, "lookups": 0,
                  "clear": int(self._clearing is not None and not self._clearing.done())}
        if sched.l3 is not None:
            inflight = sched.l3.in_flight()
            counts["prefetches"], counts["lookups"] = inflight["prefetches"], inflight["lookups"]
        return counts

    # --- attach / detach ---------------------------------------------------

    def _begin(self, cmd: _Command, now: float) -> StorageCommand | None:
        if cmd.kind == "detach":
            return self._begin_detach(cmd, now)
        spec = cmd.spec
        assert spec is not None
        sched = self._sched
        problem = self._write_policy_problem(spec.write_policy)
        if problem:
            _answer(cmd, 400, {"error": problem, "field": "write_policy"})
            return None
        if sched.l3 is not None:
            self._update_policies(cmd, spec, sched.l3)
            return None
        try:
            self._check_attachable()
        except ValueError as err:
            _answer(cmd, 400, {"error": str(err), "field": "backend"})
            return None
        cfg = dataclasses.replace(sched.cfg, storage=spec.storage)
        try:
            planner = self._build_planner(cfg)
        except (ValueError, TypeError) as err:
            _answer(cmd, 400, {"error": shown_error(err), "field": "extra_config"})
            return None
        except Exception as err:  # noqa: BLE001 - a store that cannot be reached
            _answer(cmd, 502, {"error": f"backend {spec.backend!r} failed to start: "
                                        f"{shown_error(err)}"})
            return None
        canary = sched.tree.alloc(2)
        if canary is None:
            _close_quietly(planner)
            _answer(cmd, 503, {"error": "no free L2 page for the attach canary; retry"})
            return None
        txn = _Txn("attach", cmd, next(self._cmd_ids), now + self.ack_timeout_s, planner,
                   spec.write_policy, canary)
        self._txn = txn
        logger.info("HiCache L3: attaching backend %r on %d rank(s)", spec.backend,
                    self.world_size)
        return StorageCommand(txn.cmd_id, "attach", dict(spec.storage_keys),
                              (canary[0], canary[1]))

    def _begin_detach(self, cmd: _Command, now: float) -> StorageCommand | None:
        sched = self._sched
        planner = sched.l3
        if planner is None:
            _answer(cmd, 200, dict(self.snapshot(), message="no storage backend was attached"))
            return None
        sched.detach_l3()  # nothing more is planned for L3 from this step on
        self._backfill = None
        self._txn = _Txn("detach", cmd, next(self._cmd_ids), now + self.ack_timeout_s, planner)
        logger.info("HiCache L3: detaching backend %r", planner.cfg.backend)
        return StorageCommand(self._txn.cmd_id, "detach")

    def _update_policies(self, cmd: _Command, spec: AttachSpec, planner: L3Planner) -> None:
        current = planner.cfg
        if spec.backend != current.backend:
            _answer(cmd, 409, {"error": f"backend {current.backend!r} is attached; detach it "
                                        f"first (DELETE /hicache/storage-backend)"})
            return
        new = spec.storage if spec.extra_config_given else current
        if spec.extra_config_given and not _same_store(current, new):
            _answer(cmd, 409, {"error": f"backend {current.backend!r} is attached with other "
                                        "options; detach it first to change them",
                               "field": "extra_config"})
            return
        policy = spec.storage.prefetch_policy if spec.prefetch_policy_given \
            else current.prefetch_policy
        planner.update_policy(dataclasses.replace(new, prefetch_policy=policy))
        self._set_write_policy(spec.write_policy)
        logger.info("HiCache L3: backend %r policies updated: prefetch=%s write=%s",
                    current.backend, policy, self._sched.write_policy)
        _answer(cmd, 200, dict(self.snapshot(), message="policies updated"))

    def _write_policy_problem(self, name: str | None) -> str:
        current = self._sched.write_policy
        if name is None or name == current or WritePolicyName.WRITE_BACK not in (name, current):
            return ""
        return (f"hicache_write_policy cannot change from {current} to {name} at run time "
                "(write_back hooks vLLM's block pool at start); restart with it")

    def _set_write_policy(self, name: str | None) -> None:
        if name is not None:
            self._sched.set_write_policy(name)

    def on_acks(self, acks: Mapping[int, Mapping[int, str]]) -> None:
        """Worker acknowledgements (update_connector_output)."""
        txn = self._txn
        if txn is None or txn.cmd_id not in acks:
            return
        txn.acks.update(acks[txn.cmd_id])
        if len(txn.acks) >= self.world_size:
            self._finish(txn)

    def _ack_timeout(self, txn: _Txn) -> None:
        missing = sorted(set(range(self.world_size)) - set(txn.acks))
        logger.error("HiCache L3: rank(s) %s did not acknowledge %s within %g s",
                     missing, txn.kind, self.ack_timeout_s)
        for rank in missing:
            txn.acks[rank] = f"no acknowledgement within {self.ack_timeout_s:g} s"
        self._finish(txn)

    def _finish(self, txn: _Txn) -> None:
        self._txn = None
        sched = self._sched
        failed = {rank: err for rank, err in sorted(txn.acks.items()) if err}
        if txn.kind == "attach":
            # Every rank has run its canary: the scratch pages are free again.
            sched.tree.free(txn.canary_pages)
            if failed:
                self._roll_back(txn, failed)
                return
            assert txn.planner is not None, "an attach transaction carries its planner"
            sched.attach_l3(txn.planner)
            self._set_write_policy(txn.write_policy)
            self._backfill_done = None
            self._backfill = Backfill(sched.tree.hot_nodes(), BACKFILL_PAGES_PER_STEP,
                                      min(BACKFILL_MAX_INFLIGHT_PAGES,
                                          max(1, sched.num_pages // 4)))
            logger.info("HiCache L3: attached backend %r; backing up %d L2 pages",
                        txn.planner.cfg.backend, sched.tree.num_cached_pages)
            _answer(txn.cmd, 200, dict(self.snapshot(), message="attached"))
        elif txn.kind == "rollback":
            logger.error("HiCache L3: attach failed on rank(s) %s; rolled back",
                         sorted(txn.errors))
            body = {"error": "attach failed on rank(s) "
                             + ", ".join(f"{r}: {e}" for r, e in txn.errors.items())
                             + "; rolled back (no rank has the backend attached)",
                    "ranks": {str(r): e for r, e in txn.errors.items()}}
            if failed:
                body["rollback_errors"] = {str(r): e for r, e in failed.items()}
            _answer(txn.cmd, 500, body)
        else:
            assert txn.planner is not None, "a detach transaction carries its planner"
            _close_quietly(txn.planner)
            logger.info("HiCache L3: detached backend %r (stored objects are kept)",
                        txn.planner.cfg.backend)
            body = dict(self.snapshot(), message="detached")
            if failed:
                body["rank_errors"] = {str(r): e for r, e in failed.items()}
            _answer(txn.cmd, 200, body)

    def _roll_back(self, txn: _Txn, failed: dict[int, str]) -> None:
        _close_quietly(txn.planner)
        rollback = _Txn("rollback", txn.cmd, next(self._cmd_ids),
                        time.monotonic() + self.ack_timeout_s, errors=failed)
        self._txn = rollback
        self._outbox = StorageCommand(rollback.cmd_id, "detach")

    # --- clear ------------------------------------------------------------

    def _clear(self, cmd: _Command) -> None:
        planner = self._sched.l3
        if planner is None:
            _answer(cmd, 409, {"error": "no storage backend attached"})
            return
        if self._clearing is not None and not self._clearing.done():
            _answer(cmd, 409, {"error": "a clear is already running"})
            return
        # Off the engine thread: the scheduler half never waits on I/O.
        done: Future = Future()
        name = planner.cfg.backend

        def run() -> None:
            try:
                planner.clear_storage()
            except Exception as err:  # noqa: BLE001 - reported in the answer
                logger.warning("HiCache L3: clearing backend %r failed: %r", name, err)
                _answer(cmd, 502, {"error": f"clearing {name!r} failed: {shown_error(err)}"})
            else:
                logger.info("HiCache L3: backend %r cleared", name)
                _answer(cmd, 200, {"backend": name, "message": "cleared"})
            finally:
                done.set_result(None)

        self._clearing = done
        io_threads.named_thread(run, "hicache-clear").start()

    # --- backfill ----------------------------------------------------------

    def plan_backfill(self, step: int) -> list[BackupJob]:
        """This step's share of the backfill, as one BACKUP op."""
        backfill, planner = self._backfill, self._sched.l3
        if backfill is None or planner is None or self._backfill_paused:
            return []
        budget = min(backfill.pages_per_step,
                     backfill.max_inflight_pages - backfill.inflight_pages(planner))
        ranges = backfill.next_ranges(self._sched.tree, budget) if budget > 0 else []
        if not ranges:
            if backfill.done(planner):
                logger.info("HiCache L3: backup of pre-attach L2 done: %d pages in %.1f s",
                            backfill.queued_pages, time.monotonic() - backfill.started)
                self._backfill_done = backfill.report(planner)
                self._backfill = None
            return []
        jobs = planner.plan_backup(ranges, step)
        backfill.opened(jobs[0].op_id, sum(len(r.pages) for r in ranges))
        return jobs

    # --- GET ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The admin API's view: backend, options (secrets redacted),
        policies, L2 occupancy, counters. Engine thread only."""
        sched = self._sched
        planner = sched.l3
        storage = planner.cfg if planner is not None else None
        state = "attached" if planner is not None else "detached"
        if self._txn is not None:
            state = {"attach": "attaching", "detach": "detaching",
                     "rollback": "rolling back"}[self._txn.kind]
        body: dict[str, Any] = {
            "backend": storage.backend if storage is not None else None,
            "state": state,
            "extra_config": _shown_options(storage) if storage is not None else None,
            "prefetch_policy": storage.prefetch_policy if storage is not None else None,
            "prefetch": None if storage is None else {
                "threshold_tokens": storage.prefetch_threshold,
                "timeout_base_s": storage.prefetch_timeout_base,
                "timeout_per_ki_token_s": storage.prefetch_timeout_per_ki_token,
                "timeout_max_s": storage.prefetch_timeout_max,
            },
            "write_policy": sched.write_policy,
            "tiers": {"l2": sched.occupancy()},
            "stats": sched.stats_snapshot(),
            "l3_stats": None if planner is None else {
                "prefetched_blocks": planner.prefetched_blocks,
                "backed_up_blocks": planner.backed_up_blocks,
                "skipped_lookups": planner.skipped_lookups,
            },
            "backfill": (self._backfill.report(planner) if self._backfill is not None
                         else self._backfill_done),
            "requests": sched.num_requests(),
            "transfers": self.transfers(),
        }
        return body


def _same_store(a: StorageConfig, b: StorageConfig) -> bool:
    """Same backend, options and object protection (the secret compared by
    its one-way tag only)."""
    return (a.backend == b.backend and dict(a.backend_options) == dict(b.backend_options)
            and a.key_protection == b.key_protection and a.encrypt == b.encrypt)


def _shown_options(storage: StorageConfig) -> dict[str, Any]:
    shown = redacted(dict(storage.backend_options))
    if getattr(storage, "secret", None) is not None:
        shown["storage_secret"] = REDACTED
        shown["storage_encrypt"] = bool(getattr(storage, "encrypt", False))
    return shown


def _close_quietly(planner: L3Planner | None) -> None:
    if planner is None:
        return
    try:
        planner.close()
    except Exception:  # closing a client must not fail an admin call
        logger.warning("HiCache L3: closing the scheduler's backend client failed",
                       exc_info=True)


def make_control(sched: HiCacheScheduler, geom, vllm_config) -> StorageControl:
    """The state machine of an engine's scheduler half. Call it from the
    connector's constructor: that is where the engine loop to wake is found
    (vllm_compat.engine_loop_waker)."""
    from vllm_hicache.connector.vllm_compat import engine_loop_waker
    from vllm_hicache.l3.setup import (
        build_planner,
        check_shareable_hashes,
        num_workers,
    )

    return StorageControl(
        sched,
        lambda cfg: build_planner(cfg, geom, vllm_config, sched.num_pages, sched.page_states,
                                  sched.l3_context()),
        num_workers(vllm_config),
        lambda: check_shareable_hashes(vllm_config),
        engine_loop_waker(),
    )
