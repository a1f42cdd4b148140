"""L3 backend on Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

On-store format: one Mooncake object per L3 object, under the object key as
it is (``hc4-...``, keys.py); its bytes are the concatenation of the caller's buffers
(header + payload, storage/format.py), written by ``batch_put_from`` and
read by ``batch_get_into``. Mooncake publishes an object only once all its
bytes are written, and ``put`` of an existing key keeps the old object
(it does not overwrite), so readers never see a partial object. Eviction is
Mooncake's (oldest leases first, when a daemon's segment is full); a full
store rejects puts with NO_AVAILABLE_HANDLE (-200): a skipped write.

Data path: every object is copied through the registered staging area
(memory.py), the only memory this process registers with Mooncake: into a
slot before a put, out of it after a get. The host pool is deliberately not
registered (``register_memory`` does nothing): Mooncake's transfer engine
serves registered memory to any peer that reaches its port, and its
listeners cannot be bound to one interface (listeners.py). In a slot an
object is one contiguous run, so it moves with ``batch_put_from`` /
``batch_get_into`` (one slice per object, Mooncake's cheapest call).

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
from typing import Any

import numpy as np

from vllm_hicache.storage.base import Buffers, StorageBackend, StorageContext
from vllm_hicache.storage.buffers import address
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.log_throttle import LogThrottle
from vllm_hicache.storage.mooncake import listeners
from vllm_hicache.storage.mooncake.config import MooncakeConfig
from vllm_hicache.storage.mooncake.master import OutageGate, connect, import_store
from vllm_hicache.storage.mooncake.memory import (
    LEASE_WAIT_S,
    Chunk,
    StagingArea,
    fits,
    object_lengths,
    plan_chunk,
    slot_bytes_for,
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
    "bytes_read", "bytes_written", "staged_bytes", "errors", "outage_skips",
)


class MooncakeBackend(StorageBackend):
    """Objects in a Mooncake Store (see the module docstring); options:
    MooncakeConfig (config.py)."""

    name = "mooncake"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        self.config = MooncakeConfig.from_options(options)
        self.ctx = ctx
        store_cls = import_store()
        self._gate = OutageGate(self.config.outage_backoff_s)
        self._counts = Counters(*_COUNTERS)
        self._error_log = LogThrottle()
        self._pool_noted = False
        # Guards _closed, _in_flight and _staging (close() waits for calls in
        # flight).
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False
        self._staging: StagingArea | None = None
        self._slot_bytes = slot_bytes_for(ctx.object_bytes)
        before = listeners.listening_sockets()
        self._store = connect(store_cls, self.config)
        # What Mooncake's setup() started listening on (every interface).
        self.engine_listeners = listeners.listening_sockets() - before
        listeners.report(self.engine_listeners, self.config.local_hostname,
                         self.config.staging_pages * self._slot_bytes)
        try:
            # The scheduler half only asks what exists: it registers nothing.
            if ctx.role != "scheduler":
                self._staging_area()
        except BaseException:
            self._store.close()
            raise
        logger.info(
            "mooncake L3: master %s, %s, metadata %s, segment %d B, staging %d pages x %d B "
            "(%s)", self.config.master_server_address, self.config.protocol,
            self.config.metadata_server, self.config.global_segment_size,
            self.config.staging_pages, self._slot_bytes, ctx.role,
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
        # Deliberately not registered (module docstring): say so once.
        if not self._pool_noted and region.nbytes:
            self._pool_noted = True
            logger.info("mooncake L3: the %d-byte host pool is not registered with Mooncake; "
                        "pages are copied through the staging area", region.nbytes)

    def clear(self) -> None:
        # force: also objects under a read lease (a reader racing clear() gets
        # a checksum miss, not a wrong hit).
        removed = self._call([_OUR_KEYS], lambda: self._store.remove_by_regex(_OUR_KEYS, True))
        if isinstance(removed, int) and removed >= 0:
            logger.info("mooncake L3: clear removed %d objects", removed)
        else:
            logger.warning("mooncake L3: clear failed (%s)", removed)

    def stats(self) -> dict[str, float]:
        staging = self._staging
        return {**self._counts.snapshot(),
                "staging_slots": float(staging.slots if staging else 0),
                "registered_bytes": float(staging.nbytes if staging else 0)}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Calls in flight still use the store; bounded wait for them.
            if not self._idle.wait_for(lambda: self._in_flight == 0, timeout=_CLOSE_WAIT_S):
                logger.warning("mooncake L3: closing with %d calls in flight", self._in_flight)
            staging, self._staging = self._staging, None
        if staging is not None:
            self._store.unregister_buffer(address(staging.buffer))
        self._store.close()

    # --- one chunk of a batch ------------------------------------------------

    def _put_chunk(self, keys: list[str], chunk: Chunk) -> list[int]:
        for _, src, view in chunk.views():
            view[...] = src
        rcs = self._store.batch_put_from(keys, chunk.ptrs, chunk.sizes)
        self._counts.add(bytes_written=sum(n for n, rc in zip(chunk.sizes, rcs) if rc == 0),
                         put_full=rcs.count(_NO_HANDLE), staged_bytes=chunk.staged_bytes)
        return rcs

    def _get_chunk(self, keys: list[str], chunk: Chunk) -> list[int]:
        rcs = self._store.batch_get_into(keys, chunk.ptrs, chunk.sizes)
        # A short or long read is a miss, whatever Mooncake says.
        oks = [rc == size > 0 for rc, size in zip(rcs, chunk.sizes)]
        for position, dst, view in chunk.views():
            if oks[position]:
                dst[...] = view
        self._counts.add(bytes_read=sum(n for n, ok in zip(chunk.sizes, oks) if ok),
                         staged_bytes=chunk.staged_bytes)
        return [0 if ok else min(rc, -1) for ok, rc in zip(oks, rcs)]

    # --- plumbing -------------------------------------------------------------

    def _staging_area(self) -> StagingArea:
        with self._lock:
            if self._closed:  # a call that outlived close()'s wait: a miss
                raise RuntimeError("mooncake backend is closed")
            if self._staging is None:
                self._staging = StagingArea(self.config.staging_pages, self._slot_bytes,
                                            self._register)
            return self._staging

    def _batched(self, keys: Sequence[str], objects: Sequence[Buffers], results: list[bool],
                 op: Callable[[list[str], Chunk], list[int]]) -> None:
        """Run ``op`` chunk by chunk (rc 0 = success per key) into ``results``;
        stop at an outage so a dead master costs one timeout per call. An
        object that fits no slot is a per-key False."""
        assert len(keys) == len(objects), (len(keys), len(objects))

        def run() -> list[int]:
            staging = self._staging_area()
            lengths = object_lengths(objects)
            sendable = fits(lengths, staging.slot_bytes)
            rcs, lo = [-1] * len(keys), 0
            while (left := sum(sendable[lo:])) > 0:
                try:
                    with staging.lease(left, LEASE_WAIT_S) as slots:
                        chunk = plan_chunk(objects, lengths, lo, slots)
                        part = op([keys[i] for i in chunk.sent], chunk)
                except TimeoutError as err:  # the rest of the batch misses
                    logger.warning("mooncake L3: %s; %d objects skipped", err, left)
                    break
                if len(part) == len(chunk.sent):
                    for i, rc in zip(chunk.sent, part):
                        rcs[i] = rc
                lo = chunk.hi
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
        return self._store.register_buffer(address(buf), buf.nbytes) == 0


def _saw_rpc_failure(result: Any) -> bool:
    if isinstance(result, list):
        return _RPC_FAIL in result
    return result == _RPC_FAIL
