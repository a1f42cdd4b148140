"""Async loads: L2 -> L1 copies for requests waiting in WAITING_FOR_REMOTE_KVS.

They run between steps, off the forward's critical path: on CPU in one
background thread, on CUDA on the data path's transfer stream with one event
per job. A request is reported finished only after its copy completed; a
failed copy reports its blocks as load errors in the same poll, so vLLM
recomputes them instead of using them. A copy that raises never propagates:
on CPU the thread's future holds the error, on CUDA the exception at issue
time marks the job failed. Either way the request is still reported
finished, or the scheduler would keep its pages locked forever.

Safety: the destination blocks belong to the waiting request alone, and the
source pages stay locked by the scheduler half until it sees the request
finished.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm_hicache import io_threads
from vllm_hicache.common.jobs import LoadJob
from vllm_hicache.datapath.grouped import copy_bytes

logger = logging.getLogger(__name__)


class AsyncLoader:
    def __init__(self, transfer, stream=None, clock=None, page_bytes: int = 0) -> None:
        # The copy engine (a KVTransfer); the data path swaps it in place.
        self.transfer = transfer
        self._stream = stream
        # Times the copies for metrics (datapath/clock.CopyClock); None: untimed.
        self._clock = clock
        self._page_bytes = page_bytes
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="hicache-load",
                               initializer=io_threads.enter_io_thread)
            if stream is None else None
        )
        # req_id -> (job, future or CUDA event)
        self._inflight: dict[str, tuple[LoadJob, object]] = {}
        # Jobs already known to have failed when they were issued; their
        # handle only says when it is safe to report them.
        self._failed: set[str] = set()

    def submit(self, job: LoadJob) -> None:
        copy = job.copy
        if self._executor is not None:
            handle = self._executor.submit(self._timed_load, copy.block_ids, copy.page_ids)
        else:
            handle = self._submit_on_stream(job)
        self._inflight[job.req_id] = (job, handle)

    def _timed_load(self, block_ids, page_ids, stream=None) -> None:
        if self._clock is None:
            self.transfer.load(block_ids, page_ids)
            return
        started = self._clock.start(stream)
        self.transfer.load(block_ids, page_ids)
        self._clock.stop(started, "load", copy_bytes(self.transfer, block_ids, self._page_bytes),
                         stream)

    def _submit_on_stream(self, job: LoadJob):
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            try:
                self._timed_load(job.copy.block_ids, job.copy.page_ids, self._stream)
            except Exception:  # a failed copy must become a recompute, not a crash
                logger.exception("HiCache: async load of %s failed to start", job.req_id)
                self._failed.add(job.req_id)
            # Recorded even after a failure: copies the transfer queued before
            # raising still write this request's blocks, and vLLM must not
            # recompute into them until those writes have landed.
            handle = torch.cuda.Event()
            handle.record(self._stream)
        return handle

    def fail(self, job: LoadJob) -> None:
        """Report ``job`` finished with every block failed, copying nothing
        (its source pages are known to be bad)."""
        handle: Future = Future()
        handle.set_result(None)
        self._failed.add(job.req_id)
        self._inflight[job.req_id] = (job, handle)

    def poll(self) -> tuple[set[str], set[int]]:
        """Requests whose load finished, and blocks whose load failed."""
        done: set[str] = set()
        failed: set[int] = set()
        for req_id, (job, handle) in list(self._inflight.items()):
            if not self._is_done(handle):
                continue
            del self._inflight[req_id]
            done.add(req_id)
            error = handle.exception() if isinstance(handle, Future) else None
            if error is not None:
                logger.error("HiCache: async load of %s failed: %r", req_id, error)
            if req_id in self._failed or error is not None:
                self._failed.discard(req_id)
                failed.update(job.copy.block_ids)
        return done, failed

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (bounded, polling) until every submitted copy is done; True
        if they all are. Nothing is reported: ``poll`` still does that."""
        deadline = time.monotonic() + timeout_s
        while any(not self._is_done(handle) for _, handle in list(self._inflight.values())):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    @staticmethod
    def _is_done(handle) -> bool:
        return handle.done() if isinstance(handle, Future) else handle.query()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
