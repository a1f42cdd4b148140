"""A thread pool whose threads never hold up the process's exit.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the
interpreter exits, so one call stuck in a storage client (a dead NFS mount,
a store that stopped answering) keeps ``vllm serve`` from ever exiting, even
after our own shutdown gave up on it. L3 I/O runs here instead: its threads
are daemons, and shutdown waits only as long as its caller says. Same
``submit``/``shutdown`` surface as the executor, with real ``Future``s.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm_hicache import io_threads

_STOP = object()


class DaemonPool:
    def __init__(self, num_threads: int, name: str) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("DaemonPool.submit after shutdown")
            self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        io_threads.enter_io_thread()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False,
                 timeout_s: float | None = None) -> None:
        """Stop taking work; optionally cancel what has not started; join
        the threads for at most ``timeout_s`` (all of them: None)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel_futures:
                self._cancel_queued()
            for _ in self._threads:
                self._queue.put(_STOP)
        if wait:
            for thread in self._threads:
                thread.join(timeout_s)

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                item[0].cancel()
