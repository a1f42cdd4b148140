"""Which CPU cores the worker half's I/O threads run on.

vLLM's CPU backend binds each worker's compute (OpenMP) threads to cores of
their own and, when a KV connector is configured, keeps one more core per
rank out of the compute lists for the connector's work. A new thread starts
with the affinity of the thread that created it, so every thread the worker
half starts (L3 reads and writes, sealing, the file backend's pool, async
loads) would otherwise run on the compute cores and take its time from the
forward pass: with the file L3 on a one-core engine that is several percent
of throughput.

``configure`` (worker half, once, before it starts any thread) records the
cores left for I/O; ``enter_io_thread`` (first thing in each of our pool
threads, as the pools' initializer) moves the calling thread there. With no
such cores (a GPU platform, binding turned off, every allowed core
computing) nothing moves. Threads of the scheduler half are never pinned:
EngineCore is not bound.

Work nobody waits for (L3 backups) may run in the *background*
(``Background``, daemon_pool.py): on threads some nice steps below the
process's CPU priority. On a CPU server the core vLLM leaves for the
connector is also the one its engine core, API server and tokenizers run
on, and a backup that holds it when a step's output arrives delays the next
step. A background thread runs a store's batch itself
(``storage/batching.map_slices``, ``current_background``): no helper thread
at the engine's priority does its work, and no thread is ever started from
it, since a new thread inherits its creator's nice value and an unprivileged
process cannot give that back.

``enter_io_thread`` also gives the OS thread its Python name (``hicache-l3r-0``,
cut to the kernel's 15 characters), as ``named_thread`` does for our other
threads, so ``top -H``, ``ps -L`` and per-thread CPU accounting tell our
threads from vLLM's: Python 3.11 leaves every thread with the process title.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_io_cpus: frozenset[int] = frozenset()
_MAX_NICE = 19
# The calling pool thread's Background, if it runs in the background.
_local = threading.local()
_PR_SET_NAME = 15  # prctl(2): name the calling thread
_THREAD_NAME_BYTES = 15  # the kernel's limit, without the terminating NUL


def configure(io_cpus: frozenset[int]) -> None:
    """Set the cores for I/O threads started from now on (empty: leave them)."""
    global _io_cpus
    _io_cpus = frozenset(io_cpus)
    if _io_cpus:
        logger.info("HiCache: I/O threads run on CPU cores %s, off the compute cores",
                    sorted(_io_cpus))


@dataclass(frozen=True)
class Background:
    """Threads ``nice`` steps below the process's CPU priority, and a job
    queued ``patience_s`` is taken at the process's priority after all
    (daemon_pool.py)."""

    nice: int
    patience_s: float

    def __post_init__(self) -> None:
        if self.nice < 1 or self.patience_s < 0:
            raise ValueError(f"Background: nice >= 1, patience_s >= 0 (got {self})")


def enter_io_thread(background: Background | None = None) -> None:
    """Name the calling thread for the OS, move it to the I/O cores and,
    for ``background`` work, below the process's priority."""
    _name_native_thread(threading.current_thread().name)
    _pin_current_thread()
    _local.background = background
    if background is not None:
        _lower_priority(background.nice)


def current_background() -> Background | None:
    """The calling thread's ``Background`` (None: it runs at the process's priority)."""
    return getattr(_local, "background", None)


def _lower_priority(nice: int) -> None:
    """Run the calling thread ``nice`` steps below the process (at most at
    the lowest priority). Linux only, where each thread has a nice value of its own
    (elsewhere setpriority would name the whole process); a failure leaves it."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        # From the process's (its main thread's) value, not this thread's:
        # a thread inherits its creator's, which may be lowered already.
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        os.setpriority(os.PRIO_PROCESS, tid, min(_MAX_NICE, base + nice))
    except OSError as exc:
        logger.debug("HiCache: could not lower thread %d's priority: %s", tid, exc)


def named_thread(target: Callable[..., object], name: str, *, args: tuple = (),
                 kwargs: dict | None = None) -> threading.Thread:
    """A daemon thread (not started) that first gives the OS its name: for
    our threads that are not pool I/O (the admin API, the access log, an L3
    clear, the file backend's start-up probe). Named, never moved."""
    def run() -> None:
        _name_native_thread(name)
        target(*args, **(kwargs or {}))
    return threading.Thread(target=run, name=name, daemon=True)


def _name_native_thread(name: str) -> None:
    """Best effort: a libc without prctl (not Linux) leaves the name."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:_THREAD_NAME_BYTES], 0, 0, 0)
    except (AttributeError, OSError) as exc:
        logger.debug("HiCache: could not name thread %s: %s", name, exc)


def _pin_current_thread() -> None:
    """Move the calling thread to the I/O cores, if any were configured.
    A failure (a core taken away since) leaves the thread where it is."""
    if not _io_cpus:
        return
    try:
        os.sched_setaffinity(0, _io_cpus)  # Linux: the calling thread only
    except (OSError, ValueError) as exc:
        logger.debug("HiCache: could not move an I/O thread to %s: %s", sorted(_io_cpus), exc)


def parent_cpus() -> set[int]:
    """The cores the process that started this one may use: vLLM's CPU
    binding narrows a worker's own main thread, and so all it starts."""
    try:
        return set(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone, or not ours to ask
        return set(os.sched_getaffinity(0))


def cores_off_compute(allowed: set[int], compute: set[int]) -> frozenset[int]:
    """The cores of ``allowed`` no rank computes on (empty if no rank is
    bound, or if nothing is left)."""
    if not compute:
        return frozenset()
    return frozenset(allowed - compute)
