"""The L3 circuit breaker's driver: health checks on a thread of their own,
and the one answer the scheduler half asks for (``usable``).

A health check is one small object through the scheduler's own client of
the store: found (``exists_prefix``, what lookups ask) and read back,
compared byte for byte: what a request waits on when it hits L3. Backends
report an outage as data (a False, a miss), never as an exception
(storage/base.py), so the store's answers to lookups and prefetches cannot
tell an outage from a miss: a check of an object that must be there can.
The object lives under a reserved block hash in the first namespace of this
engine: the start canary's mark (``canary.CANARY_MARK``, so
``is_canary_key`` tells it from pages too) and 16 bytes of sha256 of another
domain and the tag, so it is neither a page nor a canary; its bytes follow
from the key, so engines sharing the store share it.

A check writes the object only when it is missing or holds other bytes (the
first check, after a clear, an eviction or a corruption), then finds and
reads it again. Rewriting it every interval would time a path the data
never takes (backups skip objects already stored) and, on some
filesystems, a slow one: ext4 flushes a file's data before a rename
replaces another file: seconds on a congested disk (23 s seen), which
tripped the breaker of every engine sharing the directory while their
reads and new objects took milliseconds. Backups never hold up a request,
so a store that only refuses writes (full) is not tripped: its failed
backups are counted instead.

Threads: the monitor (``hicache-l3-health``) wakes every ``TICK_S`` at most,
starts a check when one is due, notices a running one that is overdue, and
feeds the breaker (``l3/breaker.py``); the check itself runs on a second
thread (``hicache-l3-probe``), so a check that hangs in the store only ever
costs that thread, never a step. Transitions are logged once each, as they
happen; ``usable`` is read by the scheduler once per step.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from vllm_hicache import io_threads
from vllm_hicache.daemon_pool import DaemonPool
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.breaker import (
    STATE_GAUGE,
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    Transition,
)
from vllm_hicache.l3.canary import CANARY_MARK
from vllm_hicache.storage.base import StorageBackend

logger = logging.getLogger(__name__)

# The monitor's wake-up period, at most (a fraction of the shortest setting below it).
TICK_S = 0.1

# A check: "" when the store did what was asked, else what went wrong.
Check = Callable[[], str]


def probe_key(ns: KeyNamespace) -> str:
    digest = hashlib.sha256(b"hicache-l3probe" + ns.tag.encode()).digest()
    return ns.object_keys([CANARY_MARK + digest[:16]])[0]


def round_trip_check(backend: StorageBackend, key: str, num_bytes: int) -> Check:
    """A check of ``backend``: one object of ``num_bytes`` (an L3 object's
    size, so backends that size their buffers by it take it) under ``key``,
    found and read back; written first only when it is not there as it
    should be."""
    pattern = np.frombuffer(hashlib.shake_256(key.encode()).digest(num_bytes), np.uint8)
    target = np.empty(num_bytes, np.uint8)

    def read_back() -> str:
        if backend.exists_prefix([key]) != 1:
            return "not found"
        target[:] = 0
        if not backend.get([key], [[target]])[0]:
            return "unreadable"
        return "" if np.array_equal(target, pattern) else "read back other bytes"

    def check() -> str:
        try:
            if not read_back():
                return ""
            if not backend.put([key], [[pattern]])[0]:
                return "write refused"
            failure = read_back()
            return f"written, then {failure}" if failure else ""
        except Exception as exc:  # noqa: BLE001 - any backend error is a failed check
            return f"raised {exc!r}"

    return check


class L3Health:
    """Runs the breaker's checks; thread-safe."""

    def __init__(self, cfg: BreakerConfig, check: Check, backend_name: str,
                 clock: Callable[[], float] = time.monotonic, autostart: bool = True) -> None:
        """``autostart=False``: no monitor thread; the caller drives ``step``
        (tests, with a fake clock)."""
        self._clock = clock
        self._breaker = CircuitBreaker(cfg, clock())
        self._check = check
        self._backend_name = backend_name
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._running: Future[str] | None = None
        self._pool = DaemonPool(1, "hicache-l3-probe")
        self._tick_s = min(TICK_S, cfg.probe_interval_s / 4, cfg.latency_budget_s / 2)
        self._thread = io_threads.named_thread(self._loop, "hicache-l3-health")
        if autostart:
            self._thread.start()

    @property
    def usable(self) -> bool:
        with self._lock:
            return self._breaker.usable

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._breaker.state

    @property
    def trips(self) -> int:
        with self._lock:
            return self._breaker.trips

    def state_gauge(self) -> int:
        return STATE_GAUGE[self.state]

    def status(self) -> dict[str, object]:
        with self._lock:
            return self._breaker.status(self._clock())

    def _loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a dead monitor would freeze the breaker
                logger.exception("HiCache L3 breaker: monitor step failed; continuing")

    def step(self) -> None:
        """One round of the monitor (its thread calls it; tests may too)."""
        with self._lock:
            breaker, now = self._breaker, self._clock()
            moved: list[Transition | None] = []
            running = self._running
            if running is not None and running.done():
                self._running = None
                try:
                    detail = running.result()
                except BaseException as exc:  # noqa: BLE001 - cancelled, or not an Exception
                    detail = f"raised {exc!r}"
                moved.append(breaker.check_finished(not detail, now, detail))
            elif running is not None:
                moved.append(breaker.check_overdue(now))
            # Once closed, no new check: its pool is gone (close runs on
            # another thread, maybe while this round was waking up).
            if self._running is None and breaker.due(now) and not self._stop.is_set():
                moved.append(breaker.check_started(now))
                self._running = self._pool.submit(self._check)
            cfg = breaker.cfg
        for transition in moved:
            if transition is not None:
                self._log(transition, cfg)

    def _log(self, t: Transition, cfg: BreakerConfig) -> None:
        name = self._backend_name
        if t.old == BreakerState.CLOSED:
            logger.warning(
                "HiCache L3 breaker tripped: backend %r unhealthy for %.1f s or more (%s); "
                "not using it (lookups miss, no prefetches, backups skipped), serving from "
                "L1/L2; probing every %.1f s", name, cfg.window_s, t.reason,
                cfg.probe_interval_s)
        elif t.new == BreakerState.CLOSED:
            logger.warning("HiCache L3 breaker closed: backend %r is healthy again (%s); "
                           "using it again", name, t.reason)
        else:  # tripped <-> probing: every probe interval, not worth a line each
            logger.debug("HiCache L3 breaker: %s -> %s (%s)", t.old, t.new, t.reason)

    def close(self) -> None:
        with self._lock:  # a round in progress ends before the pool does
            self._stop.set()
            # A check stuck in the store keeps its daemon thread; nothing waits on it.
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
