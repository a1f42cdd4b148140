"""L3 backend on Redis (or Valkey) through redis-py.

On-store format: one Redis string per object, under ``key_prefix + key``,
whose value is the object's bytes (header + payload, storage/format.py) as
one SET wrote them. SET replaces a value atomically, so a reader sees a whole
old or a whole new object, never a mix. Eviction is the server's:
``maxmemory`` + ``maxmemory-policy allkeys-lru`` turns L3 into an LRU cache,
and an evicted object is simply a miss. With ``noeviction`` a full server
rejects SETs (OOM), which are reported as False.

Data path, per call: keys are cut into chunks (``batch_size`` keys,
``batch_bytes`` bytes) and each chunk is one pipeline (one round trip) of
EXISTS, SET or GET per key, packed by redis_wire.py and run on a pooled
connection. A put sends the caller's buffers as they are (no payload copy);
a get copies each reply into the caller's buffers (one copy) after checking
its length.

Failures: every redis error or timeout is a miss (get), a skipped write (put)
or the end of the prefix (exists_prefix). After a connection failure the rest
of the call is skipped, so a dead or hung server costs one ``socket_timeout_s``
per call, not one per chunk. A pooled connection that broke (server restart)
is retried once at once on a fresh connection, so service resumes by itself
when the server is back. Thread-safe: the connection pool is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import redis
from redis.exceptions import RedisError, ResponseError

from vllm_hicache.storage.base import Buffers, StorageBackend, StorageContext
from vllm_hicache.storage.redis_config import RedisConfig
from vllm_hicache.storage.redis_wire import (
    exchange, make_pool, pack_keyed, pack_sets, probe_server,
)

logger = logging.getLogger(__name__)

_COUNTERS = (
    "exists_calls", "get_keys", "get_hits", "put_keys", "put_ok", "put_rejected",
    "bytes_read", "bytes_written", "errors",
)
# Rejected writes (OOM) are logged at most this often.
_REJECT_LOG_INTERVAL_S = 60.0
_CLEAR_BATCH = 1000


class RedisBackend(StorageBackend):
    """Objects as Redis strings; options (``hicache_storage_backend_extra_config``):

    - ``url`` (required): ``redis://HOST[:PORT][/DB]``, ``rediss://...`` (TLS) or
      ``unix:///PATH/redis.sock[?db=N]``; no password in it.
    - ``password`` (None): AUTH password; never logged.
    - ``key_prefix`` ("hicache:"): prepended to every key; clear() deletes
      ``key_prefix*`` only, so it must be non-empty.
    - ``socket_timeout_s`` (2.0): bound on one socket read/write.
    - ``connect_timeout_s`` (2.0, at most 5): bound on opening a connection.
    - ``max_connections`` (16): connection pool size per process.
    - ``batch_size`` (128): most commands per pipeline.
    - ``batch_bytes`` (4 MiB): most object bytes per pipeline.
    - ``startup_wait_s`` (5.0, at most 15): how long the constructor retries an
      unreachable server before raising ConnectionError.
    """

    name = "redis"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        self.config = RedisConfig.from_options(options)
        self._ctx = ctx
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._failing = False
        self._closed = False
        self._last_reject_log = -_REJECT_LOG_INTERVAL_S
        self._prefix = self.config.key_prefix.encode()
        probe_server(self.config)
        self._pool = make_pool(self.config)
        self._client = redis.Redis(connection_pool=self._pool)
        logger.info(
            "redis backend (%s, tp_rank %d): %s, key_prefix %r, %d connections, "
            "batches of %d keys / %d MiB", ctx.role, ctx.tp_rank, self.config.address,
            self.config.key_prefix, self.config.max_connections, self.config.batch_size,
            self.config.batch_bytes >> 20,
        )

    # --- the L3 interface ---

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self._count(exists_calls=1)
        found = 0
        for chunk in self._chunks([0] * len(keys)):
            names = [self._key(keys[i]) for i in chunk]
            replies = self._roundtrip("exists", pack_keyed(b"EXISTS", names), len(chunk))
            if replies is None:
                return found
            for reply in replies:
                if reply != 1:
                    return found
                found += 1
        return found

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        ok = [False] * len(keys)
        sizes = [sum(buf.nbytes for buf in bufs) for bufs in targets]
        for chunk in self._chunks(sizes):
            names = [self._key(keys[i]) for i in chunk]
            replies = self._roundtrip("get", pack_keyed(b"GET", names), len(chunk))
            if replies is None:
                break
            for i, value in zip(chunk, replies):
                ok[i] = _scatter(value, targets[i], sizes[i])
        hits = [i for i, hit in enumerate(ok) if hit]
        self._count(get_keys=len(keys), get_hits=len(hits), bytes_read=sum(sizes[i] for i in hits))
        return ok

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        ok = [False] * len(keys)
        sizes = [sum(buf.nbytes for buf in bufs) for bufs in sources]
        rejected = 0
        for chunk in self._chunks(sizes):
            names = [self._key(keys[i]) for i in chunk]
            packed = pack_sets(names, [sources[i] for i in chunk])
            replies = self._roundtrip("put", packed, len(chunk))
            if replies is None:
                break
            for i, reply in zip(chunk, replies):
                ok[i] = reply == b"OK"
                rejected += isinstance(reply, ResponseError)
        stored = [i for i, done in enumerate(ok) if done]
        self._count(put_keys=len(keys), put_ok=len(stored), put_rejected=rejected,
                    bytes_written=sum(sizes[i] for i in stored))
        if rejected:
            self._log_rejected(rejected, len(keys))
        return ok

    def clear(self) -> None:
        """Unlink every key under ``key_prefix`` (SCAN + UNLINK; never FLUSHDB).
        Raises RuntimeError if the server cannot be reached: the admin asking
        for a clear must learn that it did not happen."""
        pattern = _glob_escape(self.config.key_prefix) + "*"
        unlinked = 0
        try:
            batch: list[bytes] = []
            for key in self._client.scan_iter(match=pattern, count=_CLEAR_BATCH):
                batch.append(key)
                if len(batch) == _CLEAR_BATCH:
                    unlinked += self._client.unlink(*batch)
                    batch.clear()
            if batch:
                unlinked += self._client.unlink(*batch)
        except RedisError as err:
            raise RuntimeError(
                f"redis backend: clear() at {self.config.address} failed after "
                f"{unlinked} keys: {err}"
            ) from err
        logger.info("redis backend: clear() unlinked %d keys matching %r at %s",
                    unlinked, pattern, self.config.address)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {name: float(value) for name, value in self._counters.items()}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.disconnect()

    # --- helpers ---

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def _chunks(self, sizes: list[int]) -> Iterator[range]:
        """Consecutive index ranges of at most batch_size keys and batch_bytes
        bytes (a single bigger object is a chunk of its own)."""
        start, used = 0, 0
        for i, size in enumerate(sizes):
            full = i - start == self.config.batch_size or used + size > self.config.batch_bytes
            if full and i > start:
                yield range(start, i)
                start, used = i, 0
            used += size
        if start < len(sizes):
            yield range(start, len(sizes))

    def _roundtrip(self, op: str, chunks: list, count: int) -> list[Any] | None:
        """One packed pipeline of ``count`` commands on a pooled connection; its
        replies, error replies in place. None: the server could not be reached
        (or this backend is closed)."""
        if self._closed:
            return None
        try:
            conn = self._pool.get_connection()
        except (RedisError, OSError) as err:
            self._note_failure(op, err)
            return None
        try:
            replies = conn.retry.call_with_retry(
                lambda: exchange(conn, chunks, count), lambda _err: conn.disconnect()
            )
        except (RedisError, OSError) as err:
            conn.disconnect()  # replies may be left unread: never reuse it
            self._note_failure(op, err)
            return None
        finally:
            self._pool.release(conn)
        if self._failing:
            self._note_recovery()
        return replies

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def _note_failure(self, op: str, err: Exception) -> None:
        with self._lock:
            self._counters["errors"] += 1
            first, self._failing = not self._failing, True
        if first:
            logger.warning("redis backend: %s at %s failed (%s: %s); reads are misses and "
                           "writes are skipped until it answers again", op,
                           self.config.address, type(err).__name__, err)

    def _note_recovery(self) -> None:
        with self._lock:
            was_failing, self._failing = self._failing, False
        if was_failing:
            logger.info("redis backend: %s answers again", self.config.address)

    def _log_rejected(self, rejected: int, total: int) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_reject_log < _REJECT_LOG_INTERVAL_S:
                return
            self._last_reject_log = now
        logger.warning("redis backend: %s rejected %d of %d writes (full? check maxmemory "
                       "and maxmemory-policy)", self.config.address, rejected, total)


def _scatter(value: Any, bufs: Buffers, total: int) -> bool:
    """Copy one GET reply into the caller's buffers if it is exactly their size."""
    if not isinstance(value, bytes) or len(value) != total:
        return False
    view = np.frombuffer(value, np.uint8)
    offset = 0
    for buf in bufs:
        buf[...] = view[offset:offset + buf.size]
        offset += buf.size
    return True


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
