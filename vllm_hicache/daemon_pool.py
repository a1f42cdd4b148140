"""A thread pool whose threads never hold up the process's exit, and which
can run work nobody waits for below the engine's CPU priority.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the
interpreter exits, so one call stuck in a storage client (a dead NFS mount,
a store that stopped answering) keeps ``vllm serve`` from ever exiting, even
after our own shutdown gave up on it. L3 I/O runs here instead: its threads
are daemons, and shutdown waits only as long as its caller says. Same
``submit``/``shutdown`` surface as the executor, with real ``Future``s.

Background pools (``io_threads.Background``: L3 backups) run their jobs on threads
``nice`` steps below the process's priority, so that on a busy core the
engine's own threads go first, plus one *rescuer* thread at the process's
priority that takes any job still queued ``patience_s`` after it was
submitted: a busy core delays a backup's start by that much at most, never
indefinitely (a backup that waits is an L3 miss once L2 evicts its pages).

``hurry`` ends the background for good: when the work is what the engine
waits for after all (a graceful stop's flush time, a shutdown's drain), as
many threads again start at the caller's priority and take every queued job
at once, and the background threads retire after the job each is running.
They are new threads because a thread's nice value cannot be raised again
without CAP_SYS_NICE. Jobs start in submission order whichever thread takes
them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

from vllm_hicache import io_threads
from vllm_hicache.io_threads import Background


class _Job(NamedTuple):
    future: Future
    fn: Callable[..., Any]
    args: tuple
    submitted_s: float


class DaemonPool:
    def __init__(self, num_threads: int, name: str,
                 background: Background | None = None) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._name = name
        self._num_threads = num_threads
        self._background = background
        self._jobs: deque[_Job] = deque()
        self._closed = False
        self._hurry = False      # no patience: shut down, or hurried
        self._hurried = False    # foreground threads took over (hurry)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._threads = [
            threading.Thread(target=self._run, args=(background,), name=f"{name}-{i}",
                             daemon=True)
            for i in range(num_threads)
        ]
        if background is not None:
            self._threads.append(threading.Thread(
                target=self._run, args=(None, background.patience_s), name=f"{name}-rescue",
                daemon=True))
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("DaemonPool.submit after shutdown")
            self._jobs.append(_Job(future, fn, args, time.monotonic()))
            # A background pool's rescuer waits on a deadline: wake it too.
            if self._background is not None:
                self._changed.notify_all()
            else:
                self._changed.notify()
        return future

    @property
    def hurried(self) -> bool:
        return self._hurried

    def hurry(self) -> None:
        """From now on every job runs at the caller's priority (module doc).
        Call it from a thread at the process's priority: the new threads
        inherit the caller's nice value. Later calls, and calls on a pool
        that is not a background pool or is shut down, do nothing."""
        if io_threads.current_background() is not None:
            raise RuntimeError("DaemonPool.hurry from a background thread: its threads "
                               "would inherit the lowered priority")
        with self._lock:
            if self._background is None or self._hurried or self._closed:
                return
            self._hurry = self._hurried = True
            threads = [threading.Thread(target=self._run, args=(None,),
                                        name=f"{self._name}-h{i}", daemon=True)
                       for i in range(self._num_threads)]
            self._threads += threads
            self._changed.notify_all()
            for thread in threads:  # under the lock: shutdown joins started threads only
                thread.start()

    def _run(self, background: Background | None, patience_s: float | None = None) -> None:
        io_threads.enter_io_thread(background)
        while True:
            job = self._take(background, patience_s)
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.future.set_exception(exc)

    def _take(self, background: Background | None, patience_s: float | None) -> _Job | None:
        """The next job, in order (None: closed and nothing left, or a
        background thread of a hurried pool). With ``patience_s`` (the
        rescuer): only once it has waited that long."""
        with self._lock:
            while True:
                if background is not None and self._hurried:
                    return None
                if self._jobs:
                    if patience_s is None or self._hurry:
                        return self._jobs.popleft()
                    wait_s = self._jobs[0].submitted_s + patience_s - time.monotonic()
                    if wait_s <= 0:
                        return self._jobs.popleft()
                    self._changed.wait(wait_s)
                elif self._closed:
                    return None
                else:
                    self._changed.wait()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False,
                 timeout_s: float | None = None) -> None:
        """Stop taking work (what is queued still runs, unless cancelled);
        join the threads for at most ``timeout_s`` (all of them: None)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._hurry = True
            if cancel_futures:
                for job in self._jobs:
                    job.future.cancel()
                self._jobs.clear()
            self._changed.notify_all()
        if wait:
            for thread in self._threads:
                thread.join(timeout_s)

