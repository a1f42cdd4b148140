"""Runtime attach, replace and detach of the L3 tier: the engine side of
the admin API.

Where commands run. The admin HTTP server (admin/api.py) runs on a thread of
the EngineCore process, but the scheduler half's state belongs to the engine
loop. So ``StorageControl.submit`` queues a command and wakes the loop
(``vllm_compat.engine_loop_waker``); while a command is queued or in progress
``has_pending_push_work`` is true, so vLLM steps (an empty step when no
request runs), and the command runs in ``build_connector_meta``
(``on_step``), between steps, like everything else of the scheduler half.
The HTTP thread waits on the command's future. Every answer is
``(HTTP status, JSON body)``. One attach, replace or detach runs at a time;
GET and clear are answered in between; what GET reports is admin/status.py's.

When (``admin_storage_switch``, policy/storage_switch.py). ``live`` (the
default): commands run while requests run. ``idle`` (SGLang's rule): an
attach or detach is refused with 409 and the counts while any request is
known to the scheduler half (running, waiting or preempted); transfers in
flight (backups, prefetches, lookups, async loads, a clear) are waited for,
up to ``DRAIN_TIMEOUT_S`` with the engine stepping, then refused with 409
and their counts; a different backend needs a detach first (409).

Attach and replace (a PUT naming other options or another backend while
one is attached), two phases, the old backend serving throughout the first:

1. prepare (the step that takes the command, N): the scheduler half checks
   (block hashes shareable), builds the new planner with the next backend
   generation and allocates two free L2 pages for the canary; step N's
   metadata carries ``prepare``: every rank builds its new client beside the
   serving one and runs the canary on the two pages.
2. when every rank has acknowledged: a failure anywhere sends ``abort``
   (every rank drops its new client), closes the new planner and answers 500
   naming each failed rank; the old backend never stopped serving. Success:
   the next step (N+1, or N+2 when vLLM schedules a step ahead) carries
   ``commit`` and, in that same ``on_step`` before anything is planned, the
   scheduler half swaps the planners. Every rank swaps its client before any
   job of that step, so from N+1 on every job names the new generation and
   runs on the new client, and lookups never lack a planner. Answered when
   every rank has acknowledged the commit, with the switch's steps and
   seconds and what was pending (``pending_backups``).

Detach: the planner is removed in the step that takes the command (nothing
more is planned for it); that step's ``detach`` retires every rank's client.

The planner is installed only once every rank holds its client, and a
client is closed only after the planner stopped planning for it and its
last job ended, so nothing is ever planned for a rank without one.

The old backend retires (l3/retiring.py, l3/attach_worker.py): requests no
longer wait on its lookups (they load what L2 holds and recompute the rest,
as after a prefetch timeout); its prefetches are cancelled on the workers
(a running read stops after its current batch; what arrived is indexed);
its unwritten backups follow the call's ``pending_backups``: ``finish``
(default) writes them to the old backend, its deferred backlog too (sent in
the switching step, so no job of the old generation is made later), within
``RETIRE_DRAIN_S`` (then each rank drops what is still queued, counted);
``drop`` drops and counts them; ``move`` sends them to the new backend
(replace only). Pinned pages of open ops stay pinned until every rank acknowledged
(never earlier: a thread may still read them). Jobs, and prefetch op ids,
carry their backend generation, and every planner acts only on its own op
ids, so an acknowledgement that arrives after the switch completes the old
backend's op and never one of the new backend's. The old planner's client
closes once its last op has ended; GET shows it under ``retiring``.

Re-attaching the attached backend with the same options (or none) updates
its prefetch policy and knobs and the write policy in place, at once.

Clear and the backfill after an attach or replace (what L2 held, backed
up to the new backend in the background) are admin/clear.py's. The worker
side of a command is l3/attach_worker.py.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_hicache.admin.clear import BackfillRun, StorageClear
from vllm_hicache.admin.status import SwitchView, status_report, switch_state
from vllm_hicache.common.jobs import BackupJob, StorageCommand
from vllm_hicache.l3.retiring import RETIRE_DRAIN_S, RetiringPlanner
from vllm_hicache.policy.storage_switch import (
    DEFAULT_PENDING_BACKUPS,
    PendingBackups,
    StorageSwitch,
)
from vllm_hicache.policy.write import WritePolicyName
from vllm_hicache.redaction import shown_error
from vllm_hicache.storage_config import StorageConfig

if TYPE_CHECKING:
    from vllm_hicache.config import HiCacheConfig
    from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
    from vllm_hicache.l3.planner import L3Planner
    from vllm_hicache.scheduler.scheduler import HiCacheScheduler

logger = logging.getLogger(__name__)

# idle mode: how long an attach or detach waits for transfers in flight to finish.
DRAIN_TIMEOUT_S = 10.0
# How long the scheduler half waits for every rank's acknowledgement. Acks
# come with the output of the step that carried the command, so this only
# bounds a lost one (or a backend whose client takes that long to build).
ACK_TIMEOUT_S = 120.0


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
    # What a replace does with the old backend's unwritten backups.
    pending_backups: PendingBackups = DEFAULT_PENDING_BACKUPS


@dataclass(frozen=True)
class DetachSpec:
    """A validated detach request (admin_api.parse_detach)."""

    pending_backups: PendingBackups = DEFAULT_PENDING_BACKUPS


@dataclass(eq=False)
class _Command:
    kind: str  # "get" | "attach" | "detach" | "clear"
    spec: AttachSpec | DetachSpec | None
    future: Future
    taken: bool = False
    drain_deadline: float | None = None


@dataclass(eq=False)
class _Txn:
    """A command sent to the workers, waiting for every rank's ack."""

    kind: str  # "prepare" | "commit" | "abort" | "detach"
    cmd: _Command
    cmd_id: int
    deadline: float
    planner: L3Planner | None = None
    write_policy: str | None = None
    canary_pages: list[int] = field(default_factory=list)
    acks: dict[int, str] = field(default_factory=dict)
    # abort: the prepare's failures, reported when the abort ends.
    errors: dict[int, str] = field(default_factory=dict)
    mode: PendingBackups = DEFAULT_PENDING_BACKUPS
    # When the command was taken (monotonic s, on_step count), and what the
    # switch retired (the answer reports both).
    taken_s: float = 0.0
    taken_step: int = 0
    switched_step: int | None = None
    retiring: RetiringPlanner | None = None
    replaces: bool = False


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
        switch: StorageSwitch = StorageSwitch.LIVE,
    ) -> None:
        self._sched = sched
        self._build_planner = build_planner
        self.world_size = world_size
        self._check_attachable = check_attachable
        self.waker = waker
        self.switch = switch
        self.drain_timeout_s = DRAIN_TIMEOUT_S
        self.ack_timeout_s = ACK_TIMEOUT_S
        self.retire_drain_s = RETIRE_DRAIN_S
        self._lock = threading.Lock()  # guards _queue and _Command.taken
        self._queue: collections.deque[_Command] = collections.deque()
        self._txn: _Txn | None = None
        self._outbox: StorageCommand | None = None
        self._cmd_ids = itertools.count(1)
        # Backend generations: the planner built at start is 0.
        self._generations = itertools.count(1)
        self._steps = 0  # on_step calls: the switch's bound is counted in them
        self._backfill = BackfillRun()
        self._clear = StorageClear()
        # Replaced or detached backends finishing their ops (l3/retiring.py).
        self._retiring: list[RetiringPlanner] = []
        self._retired_last: dict[str, Any] | None = None
        self._closed = False

    # --- HTTP thread ---------------------------------------------------------

    def submit(self, kind: str, spec: AttachSpec | DetachSpec | None = None) -> Future:
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
        if txn is not None and txn.planner is not self._sched.l3 and txn.kind != "detach":
            _close_quietly(txn.planner)  # never installed: nobody else closes it
        for retiring in self._retiring:
            _close_quietly(retiring.planner)
        self._retiring = []
        for cmd in queued + ([txn.cmd] if txn is not None else []):
            _answer(cmd, 503, {"error": "the engine is shutting down"})

    # --- engine loop -----------------------------------------------------------

    def has_work(self) -> bool:
        """Keeps vLLM stepping (has_pending_push_work) while true."""
        if self._queue or self._txn is not None or self._outbox is not None:
            return True
        now = time.monotonic()
        if any(not r.done() and now < r.deadline + self.ack_timeout_s for r in self._retiring):
            return True  # its acks and pins move on only while the engine steps
        return self._backfill.can_plan(self._sched.l3)

    def scratch_pages(self) -> set[int]:
        """L2 pages held outside the tree by the admin side: an attach's
        canary, a retiring backend's open prefetches (integrity checks)."""
        pages = set(self._txn.canary_pages) if self._txn is not None else set()
        for retiring in self._retiring:
            pages |= retiring.planner.prefetch_pages()
        return pages

    def on_step(self, num_running: int) -> StorageCommand | None:
        """Run queued commands; called by build_connector_meta. Returns the
        command this step's metadata must carry to every rank, if any."""
        self._steps += 1
        self._reap()  # an old backend whose last op ended in a step with no report
        now = time.monotonic()
        if self._txn is not None and now > self._txn.deadline:
            self._ack_timeout(self._txn)
        if self._outbox is not None:
            out, self._outbox = self._outbox, None
            if out.action == "commit":
                self._swap()  # before anything of this step is planned
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
                if self.switch == StorageSwitch.IDLE:
                    verdict = self._idle_verdict(cmd, num_running, now)
                    if verdict == "wait":
                        return None
            self._pop(cmd)
            if cmd.kind == "get":
                _answer(cmd, 200, self.snapshot())
            elif cmd.kind == "clear":
                self._clear.start(self._sched.l3, functools.partial(_answer, cmd))
            elif verdict is not None:
                self._backfill.paused = False
                _answer(cmd, 409, verdict)
            else:
                self._backfill.paused = False
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
                             f"{num_requests - running} waiting requests) and "
                             "admin_storage_switch is idle; retry when idle",
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
            self._backfill.paused = cmd.kind == "detach"
        if now < cmd.drain_deadline:
            return "wait"
        return {"error": f"{cmd.kind} refused: transfers still in flight after "
                         f"{self.drain_timeout_s:g} s; retry later",
                "running": 0, "waiting": 0, "transfers": transfers}

    def transfers(self) -> dict[str, int]:
        sched = self._sched
        counts = {**sched.live_transfers(), "prefetches": 0, "lookups": 0,
                  "clear": int(self._clear.running())}
        if sched.l3 is not None:
            inflight = sched.l3.in_flight()
            counts["prefetches"], counts["lookups"] = inflight["prefetches"], inflight["lookups"]
        return counts

    # --- attach / replace / detach -------------------------------------------

    def _begin(self, cmd: _Command, now: float) -> StorageCommand | None:
        if cmd.kind == "detach":
            return self._begin_detach(cmd, now)
        spec = cmd.spec
        assert isinstance(spec, AttachSpec)
        sched = self._sched
        problem = self._write_policy_problem(spec.write_policy)
        if problem:
            _answer(cmd, 400, {"error": problem, "field": "write_policy"})
            return None
        current = sched.l3
        if current is not None and self._same_backend(spec, current):
            self._update_policies(cmd, spec, current)
            return None
        if current is not None and self.switch == StorageSwitch.IDLE:
            _answer(cmd, 409, {"error": f"backend {current.cfg.backend!r} is attached with "
                                        "other options and admin_storage_switch is idle; "
                                        "detach it first (DELETE /hicache/storage-backend)",
                               "field": "extra_config"})
            return None
        if current is None and spec.pending_backups == PendingBackups.MOVE:
            _answer(cmd, 400, {"error": "pending_backups 'move' needs an attached backend to "
                                        "move from", "field": "pending_backups"})
            return None
        try:
            self._check_attachable()
        except ValueError as err:
            _answer(cmd, 400, {"error": str(err), "field": "backend"})
            return None
        cfg = dataclasses.replace(sched.cfg, storage=self._storage_of(spec, current))
        try:
            sched.check_storage(cfg.storage)  # options this engine cannot serve
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
        generation = next(self._generations)
        planner.set_generation(generation)
        txn = _Txn("prepare", cmd, next(self._cmd_ids), now + self.ack_timeout_s, planner,
                   spec.write_policy, canary, mode=spec.pending_backups, taken_s=now,
                   taken_step=self._steps, replaces=current is not None)
        self._txn = txn
        logger.info("HiCache L3: %s backend %r (generation %d) on %d rank(s)",
                    "replacing the attached backend with" if current is not None else "attaching",
                    spec.backend, generation, self.world_size)
        return StorageCommand(txn.cmd_id, "prepare", dict(spec.storage_keys),
                              (canary[0], canary[1]), generation=generation)

    @staticmethod
    def _same_backend(spec: AttachSpec, planner: L3Planner) -> bool:
        """A PUT that names the attached backend and its options (or none):
        a policy update, not a replace."""
        current = planner.cfg
        if spec.backend != current.backend:
            return False
        return not spec.extra_config_given or _same_store(current, spec.storage)

    @staticmethod
    def _storage_of(spec: AttachSpec, current: L3Planner | None) -> StorageConfig:
        """The new backend's config; a replace keeps the prefetch policy the
        PUT does not name."""
        if current is None or spec.prefetch_policy_given:
            return spec.storage
        return dataclasses.replace(spec.storage, prefetch_policy=current.cfg.prefetch_policy)

    def _begin_detach(self, cmd: _Command, now: float) -> StorageCommand | None:
        sched = self._sched
        planner = sched.l3
        if planner is None:
            _answer(cmd, 200, dict(self.snapshot(), message="no storage backend was attached"))
            return None
        spec = cmd.spec if isinstance(cmd.spec, DetachSpec) else DetachSpec()
        if spec.pending_backups == PendingBackups.MOVE:
            _answer(cmd, 400, {"error": "pending_backups 'move' needs a backend to move to; "
                                        "a detach takes 'finish' or 'drop'",
                               "field": "pending_backups"})
            return None
        sched.detach_l3()  # nothing more is planned for L3 from this step on
        self._backfill.stop()
        retiring = self._retire(planner, spec.pending_backups, None)
        self._txn = _Txn("detach", cmd, next(self._cmd_ids), now + self.ack_timeout_s, planner,
                         mode=spec.pending_backups, taken_s=now, taken_step=self._steps,
                         switched_step=self._steps, retiring=retiring)
        logger.info("HiCache L3: detaching backend %r (pending backups: %s)",
                    planner.cfg.backend, spec.pending_backups)
        return StorageCommand(self._txn.cmd_id, "detach", generation=planner.generation,
                              pending_backups=str(spec.pending_backups))

    def _retire(self, planner: L3Planner, mode: PendingBackups,
                successor: L3Planner | None) -> RetiringPlanner:
        retiring = RetiringPlanner(planner, mode, successor, self.retire_drain_s)
        self._retiring.append(retiring)
        return retiring

    def _swap(self) -> None:
        """The commit's step: the new planner serves from here on."""
        txn = self._txn
        assert txn is not None and txn.kind == "commit" and txn.planner is not None
        sched = self._sched
        old = sched.detach_l3()
        sched.attach_l3(txn.planner)
        if old is not None:
            txn.retiring = self._retire(old, txn.mode, txn.planner)
        txn.switched_step = self._steps
        self._set_write_policy(txn.write_policy)
        self._backfill.restart(sched.tree, sched.num_pages)
        logger.info("HiCache L3: backend %r (generation %d) serves from this step; backing up "
                    "%d L2 pages to it", txn.planner.cfg.backend, txn.planner.generation,
                    sched.tree.num_cached_pages)

    def _update_policies(self, cmd: _Command, spec: AttachSpec, planner: L3Planner) -> None:
        current = planner.cfg
        new = spec.storage if spec.extra_config_given else current
        policy = spec.storage.prefetch_policy if spec.prefetch_policy_given \
            else current.prefetch_policy
        updated = dataclasses.replace(new, prefetch_policy=policy)
        try:
            self._sched.check_storage(updated)
        except ValueError as err:
            _answer(cmd, 400, {"error": str(err), "field": "prefetch_policy"})
            return
        planner.update_policy(updated)
        self._set_write_policy(spec.write_policy)
        logger.info("HiCache L3: backend %r policies updated: prefetch=%s write=%s",
                    current.backend, policy, self._sched.write_policy)
        _answer(cmd, 200, dict(self.snapshot(), message="policies updated"))

    def _write_policy_problem(self, name: str | None) -> str:
        current = self._sched.write_policy
        if name is not None:
            try:
                self._sched.cfg.l2_admission(name)  # e.g. selective with another L2 rule
            except ValueError as exc:
                return str(exc)
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
            return  # a late ack of a command that ended (timed out)
        txn.acks.update(acks[txn.cmd_id])
        if len(txn.acks) >= self.world_size:
            self._finish(txn)

    def on_worker_meta(self, meta: HiCacheWorkerMetadata) -> None:
        """Every step's worker reports: the retiring backends complete their
        own ops (their op ids only) and close once nothing of them is open."""
        for retiring in list(self._retiring):
            retiring.on_worker_meta(meta)
        self._reap()

    def _reap(self) -> None:
        clearing = self._clear.clearing()
        for retiring in [r for r in self._retiring if r.done() and r.planner is not clearing]:
            self._retiring.remove(retiring)
            self._retired_last = retiring.report()
            _close_quietly(retiring.planner)
            logger.info("HiCache L3: old backend %r (generation %d) closed: %s",
                        retiring.planner.cfg.backend, retiring.generation, self._retired_last)

    def _ack_timeout(self, txn: _Txn) -> None:
        missing = sorted(set(range(self.world_size)) - set(txn.acks))
        logger.error("HiCache L3: rank(s) %s did not acknowledge %s within %g s",
                     missing, txn.kind, self.ack_timeout_s)
        for rank in missing:
            txn.acks[rank] = f"no acknowledgement within {self.ack_timeout_s:g} s"
        self._finish(txn)

    def _finish(self, txn: _Txn) -> None:
        self._txn = None
        failed = {rank: err for rank, err in sorted(txn.acks.items()) if err}
        if txn.kind == "prepare":
            # Every rank has run its canary: the scratch pages are free again.
            self._sched.tree.free(txn.canary_pages)
            txn.canary_pages = []
            self._next_phase(txn, "abort" if failed else "commit", failed)
        elif txn.kind == "abort":
            _close_quietly(txn.planner)
            logger.error("HiCache L3: attach failed on rank(s) %s; rolled back",
                         sorted(txn.errors))
            serving = self._sched.l3
            body = {"error": "attach failed on rank(s) "
                             + ", ".join(f"{r}: {e}" for r, e in txn.errors.items())
                             + "; rolled back (" + (f"backend {serving.cfg.backend!r} still "
                                                    "serves" if serving is not None else
                                                    "no rank has the backend attached") + ")",
                    "ranks": {str(r): e for r, e in txn.errors.items()}}
            if failed:
                body["rollback_errors"] = {str(r): e for r, e in failed.items()}
            _answer(txn.cmd, 500, body)
        else:  # commit, detach: the switch happened
            assert txn.planner is not None, "a switch carries its planner"
            message = ("detached" if txn.kind == "detach"
                       else "replaced" if txn.replaces else "attached")
            logger.info("HiCache L3: %s backend %r in %d step(s), %.3f s", message,
                        txn.planner.cfg.backend, self._steps - txn.taken_step,
                        time.monotonic() - txn.taken_s)
            body = dict(self.snapshot(), message=message, switch={
                "steps": (txn.switched_step or self._steps) - txn.taken_step,
                "seconds": round(time.monotonic() - txn.taken_s, 3),
                "pending_backups": (txn.retiring.report() if txn.retiring is not None
                                    else {"pending_backups": str(txn.mode)}),
            })
            if failed:
                body["rank_errors"] = {str(r): e for r, e in failed.items()}
                logger.error("HiCache L3: %s failed on rank(s) %s: their jobs of this backend "
                             "fail (misses, unwritten backups) until it is replaced or detached",
                             txn.kind, sorted(failed))
            _answer(txn.cmd, 500 if failed else 200, body)
            self._reap()

    def _next_phase(self, txn: _Txn, kind: str, failed: dict[int, str]) -> None:
        """Send the prepare's commit (the swap happens as it is sent) or abort."""
        assert txn.planner is not None
        nxt = dataclasses.replace(txn, kind=kind, cmd_id=next(self._cmd_ids), acks={},
                                  errors=failed, deadline=time.monotonic() + self.ack_timeout_s)
        self._txn = nxt
        self._outbox = StorageCommand(nxt.cmd_id, kind, generation=txn.planner.generation,
                                      pending_backups=str(txn.mode))

    # --- backfill ----------------------------------------------------------

    def plan_backfill(self, step: int) -> list[BackupJob]:
        """Backups the admin side plans this step: the retiring backends'
        flushes (``finish``), tagged with their generation, and the share of
        the backfill, as one BACKUP op."""
        jobs = [job for retiring in self._retiring for job in retiring.plan(step)]
        return jobs + self._backfill.plan(self._sched.tree, self._sched.l3, step)

    # --- GET ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The admin API's view (admin/status.py). Engine thread only."""
        txn = self._txn
        planner = self._sched.l3
        return status_report(self._sched, SwitchView(
            state=switch_state(planner is not None, txn.kind if txn is not None else None,
                               txn is not None and txn.replaces),
            backfill=self._backfill.report(planner),
            transfers=self.transfers(),
            switch=self.switch,
            retiring=[retiring.report() for retiring in self._retiring],
            last_retired=self._retired_last,
        ))


def _same_store(a: StorageConfig, b: StorageConfig) -> bool:
    """Same backend, options and object protection (the secret compared by
    its one-way tag only)."""
    return (a.backend == b.backend and dict(a.backend_options) == dict(b.backend_options)
            and a.key_protection == b.key_protection and a.encrypt == b.encrypt)


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
        StorageSwitch(sched.cfg.admin_storage_switch),
    )
