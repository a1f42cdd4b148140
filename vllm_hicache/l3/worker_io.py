"""Worker half of the L3 tier: prefetch reads and backup writes, off the
forward's thread.

Prefetch (L3 -> L2): pages are read in batches of ``BATCH_PAGES``; progress is
the count of leading pages verified and written, reported every step until
the op finishes (a short batch ends it); with the finishing report goes the
op's ``PrefetchTiming`` (queued, reading, checking: durations on this
worker's clock). A same-step read on CPU (``by_layer``, l3/same_step.py)
is one layered read of the whole job where the store can
(``PageStore.read_by_layer``): each layer's pages are published as they
land (``wait_layer``), unverified, and the verified count when it ends.
Backup (L2 -> L3): objects L3 already
has are skipped (``exists_prefix``), the rest written; the op is acknowledged
when done, successful or not (a failed write is just a later miss). On CUDA a
backup first waits for the L1 -> L2 copy that produced its pages.

Reads and writes run on threads of their own (``num_threads`` each): a
prefetch is what a request waits for, a backup is what nobody waits for, so a
slow store's writes (every thread busy in a put) must never queue a read
behind them. With one shared FIFO they did: under ``wait_complete`` a server
then served at the store's write pace. For the same reason backups run in
the background (``BACKUPS``): below the engine's CPU priority, each started
within ``patience_s`` of its submission even on a busy core. A graceful stop
ends that (``hurry_backups``): in its flush time the backups are what the
engine waits for, and what they do not write by its end is lost.

Shutdown: a queued backup is the only way its pages reach L3 (writes are not
retried), so shutdown lets queued and running backups finish, bounded by
``drain_timeout_s``; prefetches are useless by then and are cancelled (a
running one stops at its next batch). A stuck backend costs the backups still
open at the deadline (logged), never a hung shutdown.

Retire (an admin replace or detach while requests run,
admin/storage_control.py): the client stops taking part in new work, and
``retire`` says what becomes of its open jobs. Prefetches stop: a queued one
is cancelled and reported finished with nothing read, a running one stops
after its current batch (what it read is reported and used). Backups follow
the caller's ``pending_backups``: ``finish`` lets them run; ``drop`` cancels
the queued ones and stops the running ones after their current batch, their
unwritten pages reported as failures; ``move`` hands the queued ones back, to
be submitted to the new client under the same op ids. Every job is
acknowledged exactly once, whichever client ends it, and only once no thread
of this client reads its pages any more (a page is released by its ack).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, Protocol

from vllm_hicache import io_threads
from vllm_hicache.common.jobs import BackupJob, PrefetchJob, PrefetchProgress, PrefetchTiming
from vllm_hicache.common.stats import WorkerCounters, key
from vllm_hicache.daemon_pool import DaemonPool
from vllm_hicache.io_threads import Background

if TYPE_CHECKING:
    from vllm_hicache.host import HostKVPool
    from vllm_hicache.storage.base import StorageBackend

logger = logging.getLogger(__name__)

# Backups yield the core (io_threads.py, daemon_pool.py): nobody waits for
# them, but the engine's next step does wait for the core they share. Ten
# nice steps give the engine's threads about nine tenths of a contended core
# (the kernel's weights 1024 : 110); one tenth of a second is the most a busy
# core delays a backup's start, much less than L2 keeps a page.
BACKUPS = Background(nice=10, patience_s=0.1)

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

    @property
    def reads_by_layer(self) -> bool: ...

    def read_by_layer(self, hashes: Sequence[bytes], pages: Sequence[int],
                      on_layer: Callable[[int, int], None]) -> int: ...

    def stats(self) -> dict[str, float]: ...

    def take_check_seconds(self) -> float: ...


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
        # process from exiting once shutdown has given up on it. Reads apart
        # from writes (module doc).
        self._read_pool = DaemonPool(num_threads, "hicache-l3r")
        self._write_pool = DaemonPool(num_threads, "hicache-l3w", BACKUPS)
        self._lock = threading.Lock()
        # Notified whenever a prefetch's progress changes (wait_read).
        self._read_changed = threading.Condition(self._lock)
        self._progress: dict[int, PrefetchProgress] = {}
        # Prefetch op read by layer -> per layer done, its leading pages in
        # the pool (unverified until the op finishes; PageStore.read_by_layer).
        self._layer_pages: dict[int, list[int]] = {}
        # Finished prefetch op -> its timing, until polled.
        self._timings: dict[int, PrefetchTiming] = {}
        self._backups_done: set[int] = set()
        # Backup op -> hashes not in L3 after it (KV events), until polled.
        self._backup_failures: dict[int, set[bytes]] = {}
        # Open jobs, by kind, with what they run: shutdown drains backups and
        # cancels prefetches; retire may also drop or hand back backups.
        self._prefetches: dict[Future, PrefetchJob] = {}
        self._backups: dict[Future, tuple[BackupJob, Any]] = {}
        self._stopping = threading.Event()
        # retire(drop): running backups stop after their current batch.
        self._dropping = threading.Event()

    def submit_prefetch(self, job: PrefetchJob, ready=None, by_layer: bool = False) -> None:
        """Queue the read of ``job``; ``by_layer``: deliver it layer by layer
        where the store can (``wait_layer``), for an L1 copy that runs as
        the forward reaches each layer."""
        with self._lock:
            self._progress[job.op_id] = PrefetchProgress(0, False)
        by_layer = by_layer and self.pages.reads_by_layer
        self._track(self._prefetches, self._read_pool.submit(
            self._guard, self._prefetch, job, ready, time.perf_counter(), by_layer), job)

    def submit_backup(self, job: BackupJob, ready=None) -> None:
        self._track(self._backups, self._write_pool.submit(self._guard, self._backup, job, ready),
                    (job, ready))

    def _track(self, open_jobs: dict[Future, Any], future: Future, what: Any) -> None:
        with self._lock:
            for done in [f for f in open_jobs if f.done()]:
                del open_jobs[done]
            open_jobs[future] = what

    def _open_jobs(self, open_jobs: dict[Future, Any]) -> list[Future]:
        with self._lock:
            return [f for f in open_jobs if not f.done()]

    def has_open_jobs(self) -> bool:
        """Any job submitted and not yet ended (run, failed or cancelled)?"""
        return bool(self._open_jobs(self._prefetches) or self._open_jobs(self._backups))

    def wait_prefetches(self, timeout_s: float) -> None:
        """Block until every open prefetch has ended, or ``timeout_s`` has
        passed (l3/report_wait.py: the step's report then carries them)."""
        pending = self._open_jobs(self._prefetches)
        if pending and timeout_s > 0:
            wait(pending, timeout=timeout_s)

    def wait_read(self, op_id: int, num_pages: int, timeout_s: float) -> int:
        """Leading pages of prefetch ``op_id`` verified and written, once
        they reach ``num_pages``, the read ends or ``timeout_s`` passes
        (l3/same_step.py: an L1 copy waits for them). 0 for an op this
        client does not know (never submitted, or already reported finished)."""
        def settled() -> bool:
            p = self._progress.get(op_id)
            return p is None or p.finished or p.done >= num_pages

        with self._read_changed:
            if timeout_s > 0:
                self._read_changed.wait_for(settled, timeout=timeout_s)
            progress = self._progress.get(op_id)
            return min(progress.done, num_pages) if progress is not None else 0

    def wait_layer(self, op_id: int, layer: int, num_pages: int, timeout_s: float) -> int:
        """Leading pages of prefetch ``op_id`` whose layer ``layer`` is in the
        pool, once that layer is delivered, they reach ``num_pages``, the
        read ends or ``timeout_s`` passes. Pages beyond the op's final
        ``done`` were never verified: their copies must be failed."""
        def delivered() -> int:
            p = self._progress.get(op_id)
            layers = self._layer_pages.get(op_id, ())
            return max(layers[layer] if layer < len(layers) else 0,
                       p.done if p is not None else 0)

        def settled() -> bool:
            p = self._progress.get(op_id)
            return (p is None or p.finished or delivered() >= num_pages
                    or layer < len(self._layer_pages.get(op_id, ())))

        with self._read_changed:
            if timeout_s > 0:
                self._read_changed.wait_for(settled, timeout=timeout_s)
            return min(delivered(), num_pages)

    def retire(self, pending_backups: str) -> list[tuple[BackupJob, Any]]:
        """Stop taking part in new work (see module doc); returns the queued
        backups handed back under ``move`` as (job, ready) pairs."""
        self._stopping.set()
        if pending_backups == "drop":
            self._dropping.set()
        with self._lock:
            prefetches = list(self._prefetches.items())
            backups = list(self._backups.items())
        for future, prefetch in prefetches:
            if future.cancel():  # never started: nothing of it was read
                with self._lock:
                    self._progress[prefetch.op_id] = PrefetchProgress(0, True)
                    self._read_changed.notify_all()
        moved: list[tuple[BackupJob, Any]] = []
        if pending_backups in ("drop", "move"):
            for future, (backup, ready) in backups:
                if not future.cancel():
                    continue  # running or done: it acks itself
                if pending_backups == "move":
                    moved.append((backup, ready))
                else:
                    with self._lock:
                        self._backup_failures.setdefault(backup.op_id, set()).update(
                            backup.hashes)
                        self._backups_done.add(backup.op_id)
        return moved

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
                    self._read_changed.notify_all()
                else:
                    self._backup_failures.setdefault(job.op_id, set()).update(job.hashes)
                    self._backups_done.add(job.op_id)

    def _prefetch(self, job: PrefetchJob, ready, submitted: float, by_layer: bool) -> None:
        if ready is not None:
            ready.synchronize()
        queue_s = time.perf_counter() - submitted
        self.pages.take_check_seconds()  # what this thread checked before is not ours
        if by_layer and not self._stopping.is_set():
            self._prefetch_by_layer(job, queue_s)
            return
        read_s = 0.0
        done = 0
        states: list[bool] = []  # per page read, for stores with page states
        for begin in range(0, len(job.pages), BATCH_PAGES):
            end = min(begin + BATCH_PAGES, len(job.pages))
            started = time.perf_counter()
            good = self.pages.read(job.hashes[begin:end], job.pages[begin:end], states)
            seconds = time.perf_counter() - started
            read_s += seconds
            self.counters.add_transfer("prefetch", good * self._page_bytes, seconds)
            done += good
            finished = good < end - begin or end == len(job.pages)
            if self._stopping.is_set():
                finished = True  # shutdown: nobody will use the rest
            state_pages = frozenset(i for i, valid in enumerate(states) if valid)
            if finished:
                check_s = min(read_s, self.pages.take_check_seconds())
                timing = PrefetchTiming(queue_s, read_s - check_s, check_s)
            with self._lock:
                if finished:  # before the progress: a poll never sees one without the other
                    self._timings[job.op_id] = timing
                self._progress[job.op_id] = PrefetchProgress(done, finished, state_pages)
                self._read_changed.notify_all()
            if finished:
                return

    def _prefetch_by_layer(self, job: PrefetchJob, queue_s: float) -> None:
        """The whole job in one layered read: each layer's pages are published
        as they land, the verified count when the read ends."""
        def on_layer(layer: int, num_pages: int) -> None:
            with self._lock:
                self._layer_pages.setdefault(job.op_id, []).append(num_pages)
                self._read_changed.notify_all()

        self.counters.add(key("l3_reads_by_layer"))
        started = time.perf_counter()
        good = self.pages.read_by_layer(job.hashes, job.pages, on_layer)
        read_s = time.perf_counter() - started
        self.counters.add_transfer("prefetch", good * self._page_bytes, read_s)
        check_s = min(read_s, self.pages.take_check_seconds())
        with self._lock:
            self._timings[job.op_id] = PrefetchTiming(queue_s, read_s - check_s, check_s)
            self._progress[job.op_id] = PrefetchProgress(good, True)
            self._read_changed.notify_all()

    def _backup(self, job: BackupJob, ready) -> None:
        # The rescuer's; not a stop's (hurried: every backup runs in the foreground).
        if io_threads.current_background() is None and not self._write_pool.hurried:
            self.counters.add(key("l3_backups_rescued"))
        if ready is not None:
            ready.synchronize()
        failed: list[bytes] = []
        if self._writes:
            for begin in range(0, len(job.pages), BATCH_PAGES):
                if self._dropping.is_set():  # retire(drop): the rest stays unwritten
                    failed += job.hashes[begin:]
                    break
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

    def take_removed_keys(self) -> list[str]:
        """Objects this worker's client removed from L3 (its ``max_bytes``
        LRU) since the last call, for the scheduler's KV events."""
        return self.pages.backend.take_removed_keys()

    def take_prefetch_timings(self) -> dict[int, PrefetchTiming]:
        """Timings of the prefetches finished since the last call (each one's
        is taken no later than the poll that reports it finished)."""
        with self._lock:
            timings, self._timings = self._timings, {}
        return timings

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
                    self._layer_pages.pop(op_id, None)
            backups, self._backups_done = self._backups_done, set()
        return progress, backups

    def hurry_backups(self) -> None:
        """Backups run at the engine's priority from now on (a graceful
        stop's flush time; the worker's main thread calls it)."""
        if not self._write_pool.hurried:
            self._write_pool.hurry()
            logger.info("HiCache L3: stopping: backups now run at the engine's CPU priority")

    def shutdown(self) -> None:
        self._stopping.set()
        num_cancelled = sum(f.cancel() for f in self._open_jobs(self._prefetches))
        backups = self._open_jobs(self._backups)
        start_s = time.monotonic()
        self._write_pool.hurry()  # no core to yield to a stopping engine
        drained, abandoned = wait(backups, timeout=self._drain_timeout_s)
        # Threads still stuck in the backend are left behind: waiting on them
        # is what the deadline exists to avoid.
        self._read_pool.shutdown(wait=False, cancel_futures=True)
        self._write_pool.shutdown(wait=False, cancel_futures=True)
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
