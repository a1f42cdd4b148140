"""L3 backend on Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

On-store format: one Mooncake object per L3 object, under the object key as
it is (``hc3-...``, keys.py); its bytes are the concatenation of the caller's buffers
(header + payload, storage/format.py), written by one
``batch_put_from_multi_buffers`` (a scatter/gather put) and read by one
``batch_get_into_multi_buffers``. Mooncake publishes an object only once all
its bytes are written, and ``put`` of an existing key keeps the old object
(it does not overwrite), so readers never see a partial object. Eviction is
Mooncake's (oldest leases first, when a daemon's segment is full); a full
store rejects puts with NO_AVAILABLE_HANDLE (-200): a skipped write.

Data path: zero copy from/into registered memory (the host pool, via
``register_memory``); every other buffer (the 64-byte headers) is copied
through a registered staging buffer (memory.py). Why multi-buffer
calls rather than staging whole objects for ``batch_put_from``: over TCP
loopback a second slice per object costs the engine 10-35% against one
contiguous slice, and a staging copy of the whole object cost as much on the
2-core test VM, while RDMA makes extra slices nearly free and copies not.

Results: put is True iff rc == 0; get is True iff rc == the expected length
(Mooncake returns the bytes read, or a negative code: -704 not found, -800
transfer failed, -900 master unreachable, -600 buffer too small); any other
outcome, or an exception, is a miss / skipped write.

Outages: while the master is down every Mooncake call fails with RPC_FAIL
(-900) after ~4.3 s (its internal RPC timeout). The first such failure opens
an ``OutageGate``: for ``outage_backoff_s`` calls return misses at once, then
one call probes; success closes it. So a call takes at most ~4.5 s, and only
the probing call pays it. Service resumes by itself when the master is back
(the client re-attaches without a new setup; the restarted master's index is
empty, so earlier objects are gone).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np

from vllm_hicache.storage.base import Buffers, StorageBackend, StorageContext
from vllm_hicache.storage.buffers import address
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.log_throttle import LogThrottle
from vllm_hicache.storage.mooncake.config import MooncakeConfig
from vllm_hicache.storage.mooncake.master import OutageGate, connect, import_store
from vllm_hicache.storage.mooncake.memory import (
    ChunkPlan,
    RegisteredRegions,
    ScratchLeases,
    plan_chunks,
)

logger = logging.getLogger(__name__)

_RPC_FAIL = -900
_NO_HANDLE = -200
# clear() removes the objects of every vllm_hicache namespace and key version
# (keys.py: "hc<version>-...") and nothing else: the cluster may hold other
# users' objects.
_OUR_KEYS = "^hc[0-9]+-"
_CLOSE_WAIT_S = 10.0
_COUNTERS = (
    "exists_calls", "get_keys", "get_hits", "put_keys", "put_ok", "put_full",
    "bytes_read", "bytes_written", "direct_bytes", "staged_bytes", "errors",
    "outage_skips",
)


class MooncakeBackend(StorageBackend):
    """Objects in a Mooncake Store (see the module docstring); options:
    MooncakeConfig (config.py)."""

    name = "mooncake"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        self.config = MooncakeConfig.from_options(options)
        self.ctx = ctx
        store_cls = import_store()
        self._regions = RegisteredRegions()
        # Buffers registered with Mooncake (kept alive until close()).
        self._registered: list[np.ndarray] = []
        capacity = max(self.config.staging_bytes, ctx.object_bytes + 256)
        self._staging = ScratchLeases(capacity, self._register)
        self._gate = OutageGate(self.config.outage_backoff_s)
        self._counts = Counters(*_COUNTERS)
        self._error_log = LogThrottle()
        # Guards _closed and _in_flight (close() waits for calls in flight).
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False
        self._store = connect(store_cls, self.config)
        logger.info(
            "mooncake L3: master %s, %s, metadata %s, segment %d B, staging %d B (%s)",
            self.config.master_server_address, self.config.protocol,
            self.config.metadata_server, self.config.global_segment_size, capacity, ctx.role,
        )

    # --- the interface ------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        flags = self._call(keys, lambda: self._store.batch_is_exist(list(keys)), "exists_calls")
        return sum(1 for _ in itertools.takewhile(lambda f: f == 1, flags or ()))

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        results = [False] * len(keys)
        self._batched(keys, targets, results, self._get_chunk)
        self._counts.add(get_keys=len(keys), get_hits=sum(results))
        return results

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        results = [False] * len(keys)
        self._batched(keys, sources, results, self._put_chunk)
        self._counts.add(put_keys=len(keys), put_ok=sum(results))
        return results

    def register_memory(self, region: np.ndarray) -> None:
        if self._closed or not region.nbytes or self._regions.covers(region):
            return
        if region.flags.c_contiguous and self._register(region):
            self._regions.add(address(region), region.nbytes)
            logger.info("mooncake L3: registered %d B of host memory (zero copy)", region.nbytes)
        else:
            logger.warning("mooncake L3: could not register %d B of host memory; "
                           "its pages are copied through staging", region.nbytes)

    def clear(self) -> None:
        # force: also objects under a read lease (a reader racing clear() gets
        # a checksum miss, not a wrong hit).
        removed = self._call([_OUR_KEYS], lambda: self._store.remove_by_regex(_OUR_KEYS, True))
        if isinstance(removed, int) and removed >= 0:
            logger.info("mooncake L3: clear removed %d objects", removed)
        else:
            logger.warning("mooncake L3: clear failed (%s)", removed)

    def stats(self) -> dict[str, float]:
        return {**self._counts.snapshot(), "registered_regions": float(len(self._regions)),
                "staging_buffers": float(len(self._staging.buffers()))}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Calls in flight still use the store; bounded wait for them.
            if not self._idle.wait_for(lambda: self._in_flight == 0, timeout=_CLOSE_WAIT_S):
                logger.warning("mooncake L3: closing with %d calls in flight", self._in_flight)
        for buf in self._registered:
            self._store.unregister_buffer(address(buf))
        self._registered.clear()
        self._regions.clear()
        self._staging.drop()
        self._store.close()

    # --- one chunk of a batch ------------------------------------------------

    def _put_chunk(self, keys: list[str], chunk: ChunkPlan, staging: np.ndarray | None
                   ) -> list[int]:
        for _, src, view in chunk.views(staging):
            view[...] = src
        rcs = self._store.batch_put_from_multi_buffers(keys, chunk.ptrs, chunk.sizes)
        self._counts.add(bytes_written=sum(t for t, rc in zip(chunk.totals, rcs) if rc == 0),
                         put_full=rcs.count(_NO_HANDLE), direct_bytes=chunk.direct_bytes,
                         staged_bytes=chunk.staged_bytes)
        return rcs

    def _get_chunk(self, keys: list[str], chunk: ChunkPlan, staging: np.ndarray | None
                   ) -> list[int]:
        rcs = self._store.batch_get_into_multi_buffers(keys, chunk.ptrs, chunk.sizes)
        # A short or long read is a miss, whatever Mooncake says.
        oks = [rc == total > 0 for rc, total in zip(rcs, chunk.totals)]
        for index, dst, view in chunk.views(staging):
            if oks[index]:
                dst[...] = view
        self._counts.add(bytes_read=sum(t for t, ok in zip(chunk.totals, oks) if ok),
                         direct_bytes=chunk.direct_bytes, staged_bytes=chunk.staged_bytes)
        return [0 if ok else min(rc, -1) for ok, rc in zip(oks, rcs)]

    # --- plumbing -------------------------------------------------------------

    def _batched(self, keys: Sequence[str], objects: Sequence[Buffers], results: list[bool],
                 op: Callable[[list[str], ChunkPlan, np.ndarray | None], list[int]]) -> None:
        """Run ``op`` chunk by chunk (rc 0 = success per key) into ``results``;
        stop at an outage so a dead master costs one timeout per call."""
        assert len(keys) == len(objects), (len(keys), len(objects))

        def run() -> list[int]:
            rcs: list[int] = []
            with ExitStack() as stack:
                staging = None  # leased once, at the first chunk that stages
                for chunk in plan_chunks(objects, self._regions, self._staging.capacity):
                    if chunk.oversized:  # cannot stage it: a miss / skipped write
                        rcs.append(-1)
                        continue
                    if chunk.staged:
                        if staging is None:
                            staging = stack.enter_context(self._staging.lease())
                        chunk.bind(staging)
                    part = op(list(keys[chunk.lo:chunk.hi]), chunk, staging)
                    rcs += part if len(part) == len(chunk.totals) else [-1] * len(chunk.totals)
                    if _RPC_FAIL in part:
                        break
            return rcs

        rcs = self._call(keys, run) or []
        for i, rc in enumerate(rcs):
            results[i] = rc == 0

    def _call(self, keys: Sequence[Any], fn: Callable[[], Any], counter: str = "") -> Any:
        """``fn()`` if the backend is open and the master deemed up; None when
        skipped or on an exception (logged). Feeds the outage gate."""
        if not keys:
            return None
        with self._lock:
            if self._closed:
                return None
            self._in_flight += 1
        admitted, outcome = False, None
        try:
            admitted = self._gate.admit()
            if not admitted:
                self._counts.add(outage_skips=1)
                return None
            if counter:
                self._counts.add(**{counter: 1})
            result = fn()
            outcome = _saw_rpc_failure(result)
            return result
        except Exception:  # noqa: BLE001 - a failed call is a miss, never an error
            errors = self._counts.bump("errors")
            if self._error_log.ready():
                logger.exception("mooncake L3: call failed (%d failures so far); a miss",
                                 errors)
            return None
        finally:
            if admitted:
                self._gate.record(outcome)
            with self._lock:
                self._in_flight -= 1
                self._idle.notify_all()

    def _register(self, buf: np.ndarray) -> bool:
        ok = self._store.register_buffer(address(buf), buf.nbytes) == 0
        if ok:
            self._registered.append(buf)
        return ok


def _saw_rpc_failure(result: Any) -> bool:
    if isinstance(result, list):
        return _RPC_FAIL in result
    return result == _RPC_FAIL
