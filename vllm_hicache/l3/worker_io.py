"""Worker half of the L3 tier: prefetch reads and backup writes, off the
forward's thread.

Prefetch (L3 -> L2): pages are read in batches of ``BATCH_PAGES``; progress is
the count of leading pages verified and written, reported every step until
the op finishes (a short batch ends it). Backup (L2 -> L3): objects L3 already
has are skipped (``exists_prefix``), the rest written; the op is acknowledged
when done, successful or not (a failed write is just a later miss). On CUDA a
backup first waits for the L1 -> L2 copy that produced its pages.

Shutdown: a queued backup is the only way its pages reach L3 (writes are not
retried), so shutdown lets queued and running backups finish, bounded by
``drain_timeout_s``; prefetches are useless by then and are cancelled (a
running one stops at its next batch). A stuck backend costs the backups still
open at the deadline (logged), never a hung shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Protocol

from vllm_hicache.common.jobs import BackupJob, PrefetchJob, PrefetchProgress
from vllm_hicache.common.stats import WorkerCounters, key
from vllm_hicache.daemon_pool import DaemonPool

if TYPE_CHECKING:
    from vllm_hicache.host import HostKVPool
    from vllm_hicache.storage.base import StorageBackend

logger = logging.getLogger(__name__)

# Pages per backend call (SGLang's storage batch size).
BATCH_PAGES = 128

# How long shutdown waits for open backups before abandoning them.
SHUTDOWN_DRAIN_S = 10.0


class PageTier(Protocol):
    """What StorageIO uses of its pages: a PageStore (storage/pages.py), or
    the DisabledPageStore (canary.py) that keeps L3 off for this worker."""

    @property
    def pool(self) -> HostKVPool: ...

    @property
    def backend(self) -> StorageBackend: ...

    def exists_prefix(self, hashes: Sequence[bytes]) -> int: ...

    def write(self, hashes: Sequence[bytes], pages: Sequence[int],
              states: Sequence[bool] | None = None) -> list[bool]: ...

    def read(self, hashes: Sequence[bytes], pages: Sequence[int],
             states: list[bool] | None = None) -> int: ...

    def stats(self) -> dict[str, float]: ...


class StorageIO:
    def __init__(
        self, pages: PageTier, worker_id: int, writes: bool, num_threads: int = 2,
        drain_timeout_s: float = SHUTDOWN_DRAIN_S, counters: WorkerCounters | None = None,
    ) -> None:
        self.pages = pages
        # Metrics (stats.py); the worker half passes its own.
        self.counters = counters if counters is not None else WorkerCounters()
        self._page_bytes = pages.pool.bytes_per_page
        self._invalid_seen = 0
        # This worker's id in its reports to the scheduler, unique over
        # PP x TP ranks (l3/setup.worker_id; not the TP rank).
        self.worker_id = worker_id
        # MLA keeps one copy: only TP rank 0 writes, every rank still acks.
        self._writes = writes
        self._drain_timeout_s = drain_timeout_s
        # Daemon threads: a store that never answers must not keep the
        # process from exiting once shutdown has given up on it.
        self._pool = DaemonPool(num_threads, "hicache-l3")
        self._lock = threading.Lock()
        self._progress: dict[int, PrefetchProgress] = {}
        self._backups_done: set[int] = set()
        # Backup op -> hashes not in L3 after it (KV events), until polled.
        self._backup_failures: dict[int, set[bytes]] = {}
        # Open jobs, by kind: shutdown drains backups and cancels prefetches.
        self._prefetches: set[Future] = set()
        self._backups: set[Future] = set()
        self._stopping = threading.Event()

    def submit_prefetch(self, job: PrefetchJob, ready=None) -> None:
        with self._lock:
            self._progress[job.op_id] = PrefetchProgress(0, False)
        self._track(self._prefetches, self._pool.submit(self._guard, self._prefetch, job, ready))

    def submit_backup(self, job: BackupJob, ready=None) -> None:
        self._track(self._backups, self._pool.submit(self._guard, self._backup, job, ready))

    def _track(self, open_jobs: set[Future], future: Future) -> None:
        with self._lock:
            open_jobs.difference_update([f for f in open_jobs if f.done()])
            open_jobs.add(future)

    def _open_jobs(self, open_jobs: set[Future]) -> list[Future]:
        with self._lock:
            return [f for f in open_jobs if not f.done()]

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (bounded) for every submitted job; True if all finished."""
        pending = self._open_jobs(self._prefetches) + self._open_jobs(self._backups)
        done, not_done = wait(pending, timeout=timeout_s)
        return not not_done

    def _guard(self, fn, *args) -> None:
        # A worker thread must never die: an error becomes a miss/an ack.
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            # One line, no traceback: an unreachable store fails every job.
            job = args[0]
            kind = "prefetch" if isinstance(job, PrefetchJob) else "backup"
            logger.warning("HiCache L3 %s of %d pages failed: %r", kind, len(job.pages), exc)
            self.counters.add(key("l3_errors", "read" if kind == "prefetch" else "write"))
            with self._lock:
                if isinstance(job, PrefetchJob):
                    progress = self._progress.get(job.op_id, PrefetchProgress(0, False))
                    self._progress[job.op_id] = progress._replace(finished=True)
                else:
                    self._backup_failures.setdefault(job.op_id, set()).update(job.hashes)
                    self._backups_done.add(job.op_id)

    def _prefetch(self, job: PrefetchJob, ready) -> None:
        if ready is not None:
            ready.synchronize()
        done = 0
        states: list[bool] = []  # per page read, for stores with page states
        for begin in range(0, len(job.pages), BATCH_PAGES):
            end = min(begin + BATCH_PAGES, len(job.pages))
            started = time.perf_counter()
            good = self.pages.read(job.hashes[begin:end], job.pages[begin:end], states)
            self.counters.add_transfer("prefetch", good * self._page_bytes,
                                       time.perf_counter() - started)
            done += good
            finished = good < end - begin or end == len(job.pages)
            if self._stopping.is_set():
                finished = True  # shutdown: nobody will use the rest
            state_pages = frozenset(i for i, valid in enumerate(states) if valid)
            with self._lock:
                self._progress[job.op_id] = PrefetchProgress(done, finished, state_pages)
            if finished:
                return

    def _backup(self, job: BackupJob, ready) -> None:
        if ready is not None:
            ready.synchronize()
        failed: list[bytes] = []
        if self._writes:
            for begin in range(0, len(job.pages), BATCH_PAGES):
                hashes = job.hashes[begin : begin + BATCH_PAGES]
                pages = job.pages[begin : begin + BATCH_PAGES]
                states = job.states[begin : begin + BATCH_PAGES] or None
                started = time.perf_counter()
                # An object already there is kept, also one without a valid
                # state where this page has one (page_states.py).
                have = self.pages.exists_prefix(hashes)
                if have < len(hashes):
                    stored = self.pages.write(hashes[have:], pages[have:],
                                              states[have:] if states else None)
                    failed += [h for h, ok in zip(hashes[have:], stored) if not ok]
                    num_stored = sum(stored)
                else:
                    num_stored = 0
                self.counters.add_transfer("backup", num_stored * self._page_bytes,
                                           time.perf_counter() - started)
                self.counters.add(key("store_skipped_blocks", "L3", "present"), have)
                self.counters.add(key("store_skipped_blocks", "L3", "rejected"),
                                  len(hashes) - have - num_stored)
        with self._lock:
            if failed:
                self._backup_failures.setdefault(job.op_id, set()).update(failed)
            self._backups_done.add(job.op_id)

    def take_backup_failures(self) -> dict[int, set[bytes]]:
        """Failures of backups acknowledged in a poll so far (a backup's
        failures are recorded before its ack)."""
        with self._lock:
            failures, self._backup_failures = self._backup_failures, {}
        return failures

    def take_invalid_objects(self) -> int:
        """Objects that did not verify since the last call."""
        total = int(self.pages.stats().get("invalid_objects", 0))
        new, self._invalid_seen = max(0, total - self._invalid_seen), total
        return new

    def poll(self) -> tuple[dict[int, PrefetchProgress], set[int]]:
        """Progress of open prefetches (finished ones reported once), and the
        backups finished since the last poll."""
        with self._lock:
            progress = dict(self._progress)
            for op_id, p in progress.items():
                if p.finished:
                    del self._progress[op_id]
            backups, self._backups_done = self._backups_done, set()
        return progress, backups

    def shutdown(self) -> None:
        self._stopping.set()
        num_cancelled = sum(f.cancel() for f in self._open_jobs(self._prefetches))
        backups = self._open_jobs(self._backups)
        start_s = time.monotonic()
        drained, abandoned = wait(backups, timeout=self._drain_timeout_s)
        # Threads still stuck in the backend are left behind: waiting on them
        # is what the deadline exists to avoid.
        self._pool.shutdown(wait=False, cancel_futures=True)
        if abandoned:
            logger.warning(
                "HiCache L3: shutdown abandoned %d of %d open backups after %.1f s "
                "(their pages will miss in L3)",
                len(abandoned), len(backups), time.monotonic() - start_s,
            )
        logger.info(
            "HiCache L3: shutdown drained %d backups, cancelled %d queued prefetches",
            len(drained), num_cancelled,
        )
        self.pages.backend.close()
