"""The L3 lookups of arriving requests: the store's ``exists_prefix`` calls,
on one background thread, so the scheduler never waits on I/O.

A lookup answers how many blocks of ``chain[start:]`` every rank's objects
hold (min over the key namespaces); with a node tier in front of the store,
also how many of those the node tier holds (``node_found``). The scheduler's
thread starts lookups, reads their answers and drops them; the lookup
thread only runs the store calls and appends the finished lookup to a queue
the scheduler drains once per step (so a step costs O(finished), never a
scan of every lookup).

Bounds: at most ``MAX_PENDING_LOOKUPS`` queued or running (a slow or dead
store must not build an unbounded backlog: a request past it gets no L3
hit), and one schedule pass blocks at most ``LOOKUP_WAIT_PER_STEP_S`` in
total waiting for answers (``await_answer``): a store that answers in that
time saves the request a step; a slower one costs each step at most that.

What a lookup leads to (a prefetch op, whether its request waits) is the
planner's business (l3/planner.py, its ops l3/prefetch_ops.py): they set
``op``, ``done``, ``timed_out`` on the records they get from here. No
torch, no vLLM.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from vllm_hicache.daemon_pool import DaemonPool
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.hit_stages import HitTimes
from vllm_hicache.storage import StorageBackend
from vllm_hicache.storage.node_chain import NodeChainBackend

logger = logging.getLogger(__name__)

# Lookups queued or running at once, at most (one lookup thread).
MAX_PENDING_LOOKUPS = 256
# Seconds one schedule pass may block, in total, for lookups to answer.
LOOKUP_WAIT_PER_STEP_S = 0.002


@dataclass(slots=True)
class L3Lookup:
    chain: tuple[bytes, ...]   # hashes of blocks 0 .. limit
    start: int
    deadline: float
    future: Future[int]        # the store's hit count for chain[start:]
    times: HitTimes            # for the request's hit stages (hit_stages.py)
    # The prefetch op for this lookup (l3/prefetch_ops.py ``PrefetchOp``; Any:
    # that module imports this one).
    op: Any = None
    done: bool = False         # nothing (more) to wait for
    timed_out: bool = False    # counted as prefetches{event=timed_out}
    nowait: bool = False       # hicache_load_decision declined to wait for it
    # [blocks of chain[start:] the node tier had], set by the lookup thread
    # (a holder: the lookup may finish before this record exists).
    node_found: list[int] = field(default_factory=lambda: [0])


class L3Lookups:
    """The lookups of one planner's backend, by request id. Called from the
    scheduler's thread only (the lookup thread touches just the pending
    count, the finished queue, the round-trip times and ``errors``)."""

    def __init__(self, backend: StorageBackend, namespaces: list[KeyNamespace]) -> None:
        self.backend = backend
        self.namespaces = namespaces
        self._executor = DaemonPool(1, "hicache-lookup")
        self._by_req: dict[str, L3Lookup] = {}
        self._pending_lock = threading.Lock()
        self._num_pending = 0
        self._finished: collections.deque[tuple[str, L3Lookup]] = collections.deque()
        # Round trips of finished lookups (seconds), for the load gate.
        self._seconds: collections.deque[float] = collections.deque(maxlen=64)
        # What this schedule pass may still spend waiting (await_answer).
        self._wait_left_s = LOOKUP_WAIT_PER_STEP_S
        self.started = 0
        self.errors = 0  # written by the lookup thread only

    @property
    def num_pending(self) -> int:
        """Lookups queued or running."""
        return self._num_pending

    def full(self) -> bool:
        return self._num_pending >= MAX_PENDING_LOOKUPS

    def start(self, req_id: str, chain: tuple[bytes, ...], start: int, deadline: float,
              nowait: bool) -> L3Lookup:
        """Look up blocks [start, len(chain)) for ``req_id`` (check ``full``
        first); the record replaces any earlier one of the request."""
        with self._pending_lock:
            self._num_pending += 1
        node_found = [0]
        future = self._executor.submit(self.run, chain[start:], node_found)
        self.started += 1
        lookup = L3Lookup(chain, start, deadline, future, HitTimes(time.monotonic()),
                          nowait=nowait, node_found=node_found)
        self._by_req[req_id] = lookup
        future.add_done_callback(lambda _: self._finish(req_id, lookup))
        return lookup

    def _finish(self, req_id: str, lookup: L3Lookup) -> None:
        """Completion callback (lookup thread, or the caller's if already done)."""
        lookup.times.answered = time.monotonic()
        with self._pending_lock:
            self._num_pending -= 1
        if not lookup.future.cancelled() and lookup.future.exception() is not None:
            self.errors += 1
        self._finished.append((req_id, lookup))

    def run(self, hashes: tuple[bytes, ...], node_found: list[int]) -> int:
        """The store's hit for ``hashes`` (the lookup thread's work); with a
        node tier, also how many of them it found there (into
        ``node_found[0]``)."""
        if not isinstance(self.backend, NodeChainBackend):
            return self._exists(hashes)
        began = time.monotonic()
        hit = node = len(hashes)
        for ns in self.namespaces:
            found_node, found = self.backend.exists_prefix_split(ns.object_keys(hashes[:hit]))
            hit, node = min(hit, found), min(node, found_node)
            if hit == 0:
                break
        node_found[0] = min(node, hit)
        self._seconds.append(time.monotonic() - began)
        return hit

    def _exists(self, hashes: tuple[bytes, ...]) -> int:
        began = time.monotonic()
        hit = len(hashes)
        for ns in self.namespaces:
            hit = min(hit, self.backend.exists_prefix(ns.object_keys(hashes[:hit])))
            if hit == 0:
                break
        self._seconds.append(time.monotonic() - began)
        return hit

    # --- the scheduler's side ---------------------------------------------------

    def get(self, req_id: str) -> L3Lookup | None:
        return self._by_req.get(req_id)

    def __iter__(self) -> Iterator[L3Lookup]:
        return iter(self._by_req.values())

    def forget(self, req_id: str) -> L3Lookup | None:
        """Drop the request's lookup; a declined one still runs (its hit is
        counted and may be probed: the only way a declined tier is measured
        again), any other is cancelled if it has not started."""
        lookup = self._by_req.pop(req_id, None)
        if lookup is not None and not lookup.nowait:
            lookup.future.cancel()  # no-op if it already runs
        return lookup

    def await_answer(self, lookup: L3Lookup) -> None:
        """Block (within this pass's budget and the lookup's deadline) until
        the lookup answers: a step saved when the store is fast."""
        if lookup.future.done() or self._wait_left_s <= 0:
            return
        started = time.monotonic()
        timeout = min(self._wait_left_s, lookup.deadline - started)
        if timeout > 0:
            wait([lookup.future], timeout=timeout)
        self._wait_left_s -= time.monotonic() - started

    def new_pass(self) -> None:
        """The schedule pass ended: the next one may wait afresh."""
        self._wait_left_s = LOOKUP_WAIT_PER_STEP_S

    @staticmethod
    def hit(lookup: L3Lookup) -> int:
        """The lookup's answer (it has finished); a failed lookup is a miss."""
        try:
            return lookup.future.result()
        except Exception as exc:  # noqa: BLE001 - a failed lookup is a miss
            # One line, no traceback: a dead store fails every lookup.
            logger.warning("HiCache L3 lookup failed, counted as a miss: %r", exc)
            return 0

    def take_finished(self) -> Iterator[tuple[str, L3Lookup]]:
        """The lookups that finished since the last call, each once, with
        whether they are still their request's (``get(req_id) is lookup``)."""
        while self._finished:
            yield self._finished.popleft()

    def take_seconds(self) -> Iterator[float]:
        """Round trips of the lookups finished since the last call."""
        while self._seconds:
            yield self._seconds.popleft()

    def has_finished(self) -> bool:
        return bool(self._finished)

    def stop(self) -> None:
        """Cancel what has not run and forget every lookup (a replace or
        detach: no request waits on this backend any more)."""
        for lookup in self._by_req.values():
            lookup.future.cancel()
        self._by_req.clear()
        self._finished.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
