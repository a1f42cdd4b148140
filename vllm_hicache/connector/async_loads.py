"""Async loads: L2 -> L1 copies for requests waiting in WAITING_FOR_REMOTE_KVS.

They run between steps, off the forward's critical path: on CPU in one
background thread, on CUDA on the worker's transfer stream with one event
per job. A request is reported finished (``finished_recving``) only after its
copy completed; a failed copy reports its blocks as load errors in the same
poll, so vLLM recomputes them instead of using them.

Safety: the destination blocks belong to the waiting request alone, and the
source pages stay locked by the scheduler half until it sees the request in
``finished_recving``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm_hicache.connector.metadata import LoadJob

logger = logging.getLogger(__name__)


class AsyncLoader:
    def __init__(self, transfer, stream=None) -> None:
        self._transfer = transfer
        self._stream = stream
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="hicache-load") if stream is None else None
        )
        # req_id -> (job, future or CUDA event)
        self._inflight: dict[str, tuple[LoadJob, object]] = {}

    def submit(self, job: LoadJob) -> None:
        copy = job.copy
        if self._executor is not None:
            handle = self._executor.submit(self._transfer.load, copy.block_ids, copy.page_ids)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._transfer.load(copy.block_ids, copy.page_ids)
                handle = torch.cuda.Event()
                handle.record(self._stream)
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
            if isinstance(handle, Future) and handle.exception() is not None:
                logger.error("HiCache: async load of %s failed: %r", req_id, handle.exception())
                failed.update(job.copy.block_ids)
        return done, failed

    @staticmethod
    def _is_done(handle) -> bool:
        return handle.done() if isinstance(handle, Future) else handle.query()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
