"""One rank's L3 clients, and its side of an admin attach, replace or detach
(admin/storage_control.py).

A rank holds at most one *serving* client, tagged with the backend
generation the scheduler half gave it; one *staged* client per prepared
generation, built and canaried while the serving one still works; and any
number of *retiring* clients, finishing (or dropping) the jobs they were
given before a switch. A step's ``StorageCommand`` runs before anything else
of the step and is acknowledged in the worker metadata with its error or "":

- ``prepare``: build the client of ``generation`` and run its canary; stage
  it. The serving client is untouched, whatever fails.
- ``commit``: the staged client of ``generation`` serves from this step on;
  the one it replaces retires with the command's ``pending_backups``
  (``move``: its queued backups are submitted to the new client under the
  same op ids). Sent only once every rank has acknowledged its prepare.
- ``abort``: drop the staged client of ``generation``.
- ``detach``: the serving client retires; none serves.

Jobs name their generation and go to that generation's client. A job whose
client is gone (a bug, or a generation retired and closed) is reported at
once, a prefetch as finished with nothing read, a backup as acknowledged with
every page failed, so the scheduler half never waits on a job nobody runs.
Reports of every client are merged: prefetch op ids carry their generation
(l3/planner.py) and backup op ids are unique in the scheduler's PageOps, so a
late report of an old client can only reach the op it belongs to.

A retiring client is shut down (on a thread: closing a store may block) once
no job of it is open and its last reports are taken; past ``RETIRE_DRAIN_S``
its queued backups are dropped as under ``drop`` (a job already writing is
never cut off mid-batch: its pages are released only by its own ack).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_hicache import io_threads
from vllm_hicache.common.jobs import (
    BackupJob,
    PrefetchJob,
    PrefetchProgress,
    PrefetchTiming,
    StorageCommand,
)
from vllm_hicache.l3.canary import DisabledPageStore
from vllm_hicache.l3.retiring import RETIRE_DRAIN_S
from vllm_hicache.l3.worker_io import StorageIO
from vllm_hicache.redaction import shown_error
from vllm_hicache.storage_config import StorageConfig, parse_storage

logger = logging.getLogger(__name__)


# Builds a rank's client for a storage config; ``canary_pages``: two free
# host pages the start canary may use (l3/canary.py).
BuildIO = Callable[[StorageConfig, "tuple[int, int] | None"], StorageIO]


@dataclass
class _Retiring:
    io: StorageIO
    deadline: float
    dropped: bool = False


@dataclass
class Reports:
    """What this rank's clients report in one step's worker metadata."""

    prefetch: dict[int, PrefetchProgress] = field(default_factory=dict)
    backups: set[int] = field(default_factory=set)
    failures: dict[int, set[bytes]] = field(default_factory=dict)
    # Object keys the serving client's store evicted (exact removal events);
    # a retiring client's store is not this engine's any more.
    removed: set[str] = field(default_factory=set)
    # Finished prefetches' stage timings (l3/hit_stages.py).
    timings: dict[int, PrefetchTiming] = field(default_factory=dict)


class RankL3:
    """This rank's L3 clients (see module doc)."""

    def __init__(self, io: StorageIO | None, storage: StorageConfig | None,
                 worker_id: int, retire_drain_s: float = RETIRE_DRAIN_S) -> None:
        self.io = io
        self.storage = storage
        self.generation = 0
        self.worker_id = worker_id
        self.retire_drain_s = retire_drain_s
        self._staged: dict[int, tuple[StorageIO, StorageConfig]] = {}
        self._retiring: dict[int, _Retiring] = {}
        self._orphans = Reports()
        self._orphan_generations: set[int] = set()  # warned about once each
        # Metrics of retiring clients closed since the last take_retired_counts.
        self._closed_counts: dict[str, float] = {}
        # {cmd_id: {worker id: error or ""}}, not yet reported.
        self.acks: dict[int, dict[int, str]] = {}

    # --- commands ----------------------------------------------------------

    def run(self, cmd: StorageCommand, build: BuildIO) -> None:
        """Run one admin command; its ack goes to ``acks``."""
        try:
            if cmd.action == "prepare":
                self._prepare(cmd, build)
            elif cmd.action == "commit":
                self._commit(cmd)
            elif cmd.action == "abort":
                staged = self._staged.pop(cmd.generation, None)
                if staged is not None:
                    _close_later(staged[0])
            elif cmd.action == "detach":
                self._retire_serving(cmd.pending_backups)
                self.io, self.storage = None, None
            else:
                raise ValueError(f"unknown storage command {cmd.action!r}")
            error = ""
        except Exception as err:  # noqa: BLE001 - reported; the scheduler decides
            error = shown_error(err)
            logger.warning("HiCache L3: %s on worker %d failed: %s", cmd.action,
                           self.worker_id, error)
        self.acks.setdefault(cmd.cmd_id, {})[self.worker_id] = error

    def _prepare(self, cmd: StorageCommand, build: BuildIO) -> None:
        storage = parse_storage(cmd.storage_keys or {})
        if storage is None:
            raise ValueError("prepare command names no hicache_storage_* keys")
        new_io = build(storage, cmd.canary_pages)
        if isinstance(new_io.pages, DisabledPageStore):
            new_io.shutdown()
            raise RuntimeError(new_io.pages.reason)
        old = self._staged.pop(cmd.generation, None)
        if old is not None:
            _close_later(old[0])
        self._staged[cmd.generation] = (new_io, storage)

    def _commit(self, cmd: StorageCommand) -> None:
        staged = self._staged.pop(cmd.generation, None)
        if staged is None:
            raise RuntimeError(f"no client was prepared for backend generation {cmd.generation}")
        moved = self._retire_serving(cmd.pending_backups)
        self.io, self.storage = staged
        self.generation = cmd.generation
        for job, ready in moved:
            self.io.submit_backup(job, ready)

    def _retire_serving(self, pending_backups: str) -> list[tuple[BackupJob, Any]]:
        io = self.io
        if io is None:
            return []
        moved = io.retire(pending_backups)
        self._retiring[self.generation] = _Retiring(
            io, time.monotonic() + self.retire_drain_s, dropped=pending_backups == "drop")
        return moved

    # --- jobs --------------------------------------------------------------

    def _client(self, generation: int) -> StorageIO | None:
        if self.io is not None and generation == self.generation:
            return self.io
        retiring = self._retiring.get(generation)
        return retiring.io if retiring is not None else None

    def submit_prefetch(self, job: PrefetchJob, ready=None, by_layer: bool = False) -> None:
        io = self._client(job.generation)
        if io is None or io is not self.io:  # retiring clients read nothing new
            self._orphan(job.generation)
            self._orphans.prefetch[job.op_id] = PrefetchProgress(0, True)
            return
        io.submit_prefetch(job, ready, by_layer)

    def submit_backup(self, job: BackupJob, ready=None) -> None:
        io = self._client(job.generation)
        if io is None:
            self._orphan(job.generation)
            self._orphans.failures.setdefault(job.op_id, set()).update(job.hashes)
            self._orphans.backups.add(job.op_id)
            return
        io.submit_backup(job, ready)

    def _orphan(self, generation: int) -> None:
        if generation not in self._orphan_generations:
            self._orphan_generations.add(generation)
            logger.warning("HiCache L3: worker %d holds no client of backend generation %d; "
                           "its jobs end at once (misses, unwritten backups)",
                           self.worker_id, generation)

    def wait_read(self, generation: int, op_id: int, num_pages: int, timeout_s: float) -> int:
        """Leading pages of prefetch ``op_id`` read so far, waiting as
        ``StorageIO.wait_read``; 0 where no serving client of ``generation``
        runs it (the blocks are then recomputed)."""
        io = self._client(generation)
        if io is None or io is not self.io:
            return 0
        return io.wait_read(op_id, num_pages, timeout_s)

    def wait_layer(self, generation: int, op_id: int, layer: int, num_pages: int,
                   timeout_s: float) -> int:
        """Leading pages of prefetch ``op_id`` whose layer ``layer`` is in the
        pool, waiting as ``StorageIO.wait_layer``; 0 as ``wait_read``."""
        io = self._client(generation)
        if io is None or io is not self.io:
            return 0
        return io.wait_layer(op_id, layer, num_pages, timeout_s)

    def hurry_backups(self) -> None:
        """A graceful stop: the backups of the serving and the retiring
        clients run at the engine's priority (StorageIO.hurry_backups).
        Called every step of the stop's flush time, so a client that starts
        serving meanwhile is hurried too."""
        for retiring in self._retiring.values():
            retiring.io.hurry_backups()
        if self.io is not None:
            self.io.hurry_backups()

    def wait_prefetches(self, timeout_s: float) -> None:
        """Give the serving client's open prefetches up to ``timeout_s`` to
        end (l3/report_wait.py); a retiring client reads nothing new."""
        if self.io is not None:
            self.io.wait_prefetches(timeout_s)

    # --- reports -----------------------------------------------------------

    def take_reports(self) -> Reports:
        """Every client's progress, acks and failures since the last call;
        closes the retiring clients that are done."""
        out, self._orphans = self._orphans, Reports()
        now = time.monotonic()
        for generation, retiring in list(self._retiring.items()):
            if not retiring.dropped and now > retiring.deadline:
                logger.warning("HiCache L3: the old backend did not finish its backups within "
                               "%g s of the switch; dropping the queued ones", self.retire_drain_s)
                retiring.dropped = True
                retiring.io.retire("drop")
            # Idle first, then poll: a job ending in between is still reported.
            idle = not retiring.io.has_open_jobs()
            _merge(out, retiring.io)
            if idle:
                del self._retiring[generation]
                _add(self._closed_counts, retiring.io.counters.take())
                _close_later(retiring.io)
        if self.io is not None:
            _merge(out, self.io)
            out.removed.update(self.io.take_removed_keys())
        return out

    def retiring_generations(self) -> list[int]:
        return sorted(self._retiring)

    def take_retired_counts(self) -> dict[str, float]:
        """Counter increments (stats.py) of the retiring clients, and of
        those closed since the last call: the serving client's are the
        worker's to take."""
        counts, self._closed_counts = self._closed_counts, {}
        for retiring in self._retiring.values():
            _add(counts, retiring.io.counters.take())
        return counts

    def shutdown(self) -> None:
        """Engine shutdown: staged clients close, retiring ones drain as the
        serving one does (StorageIO.shutdown)."""
        for io, _ in self._staged.values():
            io.shutdown()
        for retiring in self._retiring.values():
            retiring.io.shutdown()
        self._staged.clear()
        self._retiring.clear()
        if self.io is not None:
            self.io.shutdown()


def _merge(out: Reports, io: StorageIO) -> None:
    progress, backups = io.poll()
    out.timings.update(io.take_prefetch_timings())  # after the poll: none reported before its op
    out.prefetch.update(progress)
    out.backups |= backups
    for op_id, hashes in io.take_backup_failures().items():
        out.failures.setdefault(op_id, set()).update(hashes)


def _add(into: dict[str, float], counts: dict[str, float]) -> None:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v


def _close_later(io: StorageIO) -> None:
    """Shut a client down off the step: closing a store may block."""
    io_threads.named_thread(io.shutdown, "hicache-l3-close").start()
