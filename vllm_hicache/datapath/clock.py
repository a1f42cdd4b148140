"""Times the worker half's copies for metrics: bytes and seconds per
transfer kind into ``common/stats.WorkerCounters``. Here, not in
``common/``, because on CUDA it records torch events on the copy stream.
"""

from __future__ import annotations

import collections
import time

from vllm_hicache.common.stats import WorkerCounters, key

# CUDA copies whose timing events are not resolved yet, at most (a GPU far
# behind drops the oldest timings, never the byte counts).
MAX_PENDING_TIMINGS = 4096


class CopyClock:
    """Times copies for ``transfer_seconds``.

    On CPU a copy is synchronous: wall time around it. On CUDA it is only
    queued: ``start``/``stop`` record timing events on the stream the copy
    runs on (``start`` after any wait the stream does first, so waiting for
    the forward is not counted); ``collect`` adds the times of the copies the
    GPU has finished. Bytes count at ``stop``."""

    def __init__(self, counters: WorkerCounters) -> None:
        self.counters = counters
        self._pending: collections.deque = collections.deque()

    def start(self, stream=None):
        if stream is None:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def stop(self, started, op: str, num_bytes: int, stream=None) -> None:
        if stream is None:
            self.counters.add_transfer(op, num_bytes, time.perf_counter() - started)
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self.counters.add_transfer(op, num_bytes, None)
        if len(self._pending) >= MAX_PENDING_TIMINGS:
            self._pending.popleft()
        self._pending.append((started, end, op))

    def collect(self) -> None:
        pending = self._pending
        while pending and pending[0][1].query():
            started, end, op = pending.popleft()
            self.counters.add(key("transfer_seconds", op), started.elapsed_time(end) / 1e3)
