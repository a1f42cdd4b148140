"""L3 backend on Redis (or Valkey) through redis-py.

On-store format: one Redis string per object, under ``key_prefix + key``,
whose value is the object's bytes (header + payload, storage/format.py) as
one SET wrote them. SET replaces a value atomically, so a reader sees a whole
old or a whole new object, never a mix. Eviction is the server's:
``maxmemory`` + ``maxmemory-policy allkeys-lru`` turns L3 into an LRU cache,
and an evicted object is simply a miss. With ``noeviction`` a full server
rejects SETs (OOM), which are reported as False. The scheduler half's
client also listens for the keys the server evicts or expires (keyspace
notifications, removals.py), for exact L3 removal events.

Data path, per call: keys are cut into chunks (``batch_size`` keys,
``batch_bytes`` bytes) and each chunk is one pipeline (one round trip) of
EXISTS, SET or GET per key, packed by wire.py and run on a pooled
connection. A put sends the caller's buffers as they are (no payload copy);
a get copies each reply into the caller's buffers (one copy) after checking
its length.

Failures: every redis error or timeout is a miss (get), a skipped write (put)
or the end of the prefix (exists_prefix). After a connection failure the rest
of the call is skipped, so a dead or hung server costs one ``socket_timeout_s``
per call, not one per chunk. A pooled connection that broke (server restart)
is retried once at once on a fresh connection, so service resumes by itself
when the server is back. Thread-safe: the connection pool is.

With ``cluster: true`` each chunk goes through cluster.py instead of the one
pool: split by hash slot into one pipeline per master, redirections followed;
a key whose master cannot answer gets the reply None (a miss, a skipped
write) while the other masters' keys are served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import redis
from redis.exceptions import RedisError, ResponseError

from vllm_hicache.storage.base import Buffers, StorageBackend, StorageContext
from vllm_hicache.storage.batching import batched, chunks
from vllm_hicache.storage.buffers import scatter, total_bytes
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.log_throttle import LogThrottle
from vllm_hicache.storage.redis.cluster import CLUSTER_COUNTERS, ClusterLink
from vllm_hicache.storage.redis.config import RedisConfig
from vllm_hicache.storage.redis.removals import KeyspaceWatcher
from vllm_hicache.storage.redis.wire import (
    exchange,
    make_pool,
    pack_keyed,
    pack_sets,
    probe_server,
)

logger = logging.getLogger(__name__)

_COUNTERS = (
    "exists_calls", "get_keys", "get_hits", "put_keys", "put_ok", "put_rejected",
    "bytes_read", "bytes_written", "errors",
)
_CLEAR_BATCH = 1000


class RedisBackend(StorageBackend):
    """Objects as Redis strings (see the module docstring); options:
    RedisConfig (config.py)."""

    name = "redis"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        self.config = RedisConfig.from_options(options)
        self._ctx = ctx
        self._lock = threading.Lock()
        self._counts = Counters(*_COUNTERS, *(CLUSTER_COUNTERS if self.config.cluster else ()))
        # Edge-triggered: one warning when the server stops answering, one
        # line when it answers again (under _lock).
        self._failing = False
        self._closed = False
        # Rejected writes (OOM) are logged at most once a minute.
        self._reject_log = LogThrottle()
        self._prefix = self.config.key_prefix.encode()
        # cluster: true routes every command by hash slot (cluster.py); else
        # one server behind one pool.
        self._cluster: ClusterLink | None = None
        self._pool: redis.BlockingConnectionPool | None = None
        # One per engine: the scheduler half announces removals (workers would
        # repeat them). A cluster's notifications are per node: not watched
        # there (its removals stay hints, docs/l3-backends.md).
        self._watcher: KeyspaceWatcher | None = None
        if self.config.cluster:
            self._cluster = ClusterLink(self.config, self._counts)
            self._cluster.discover()
        else:
            probe_server(self.config)
            self._pool = make_pool(self.config)
            if ctx.role == "scheduler":
                self._watcher = KeyspaceWatcher(self.config, self._prefix)
        logger.info(
            "redis backend (%s, tp_rank %d): %s, key_prefix %r, %d connections, "
            "batches of %d keys / %d MiB", ctx.role, ctx.tp_rank, self._address,
            self.config.key_prefix, self.config.max_connections, self.config.batch_size,
            self.config.batch_bytes >> 20,
        )

    # --- the L3 interface ---

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self._counts.add(exists_calls=1)
        found = 0
        for chunk in self._chunks([0] * len(keys)):
            names = [self._key(keys[i]) for i in chunk]
            replies = self._exchange("exists", names, _keyed(b"EXISTS", names))
            if replies is None:
                return found
            for reply in replies:
                if reply != 1:
                    return found
                found += 1
        return found

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        ok = [False] * len(keys)
        sizes = [total_bytes(bufs) for bufs in targets]
        for chunk in self._chunks(sizes):
            names = [self._key(keys[i]) for i in chunk]
            replies = self._exchange("get", names, _keyed(b"GET", names))
            if replies is None:
                break
            for i, value in zip(chunk, replies):
                ok[i] = _scatter(value, targets[i], sizes[i])
        hits = [i for i, hit in enumerate(ok) if hit]
        self._counts.add(get_keys=len(keys), get_hits=len(hits),
                         bytes_read=sum(sizes[i] for i in hits))
        return ok

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        ok = [False] * len(keys)
        sizes = [total_bytes(bufs) for bufs in sources]
        rejected = 0
        for chunk in self._chunks(sizes):
            names = [self._key(keys[i]) for i in chunk]
            replies = self._exchange("put", names, _sets(names, [sources[i] for i in chunk]))
            if replies is None:
                break
            for i, reply in zip(chunk, replies):
                ok[i] = reply == b"OK"
                rejected += isinstance(reply, ResponseError)
        stored = [i for i, done in enumerate(ok) if done]
        self._counts.add(put_keys=len(keys), put_ok=len(stored), put_rejected=rejected,
                         bytes_written=sum(sizes[i] for i in stored))
        if rejected and self._reject_log.ready():
            logger.warning("redis backend: %s rejected %d of %d writes (full? check maxmemory "
                           "and maxmemory-policy)", self._address, rejected, len(keys))
        return ok

    def clear(self) -> None:
        """Unlink every key under ``key_prefix`` (SCAN + UNLINK; never FLUSHDB).
        Raises RuntimeError if the server cannot be reached: the admin asking
        for a clear must learn that it did not happen."""
        pattern = _glob_escape(self.config.key_prefix) + "*"
        if self._cluster is not None:
            unlinked = self._cluster.clear(pattern)
            logger.info("redis backend: clear() unlinked %d keys matching %r at %s",
                        unlinked, pattern, self._address)
            return
        unlinked = 0
        client = redis.Redis(connection_pool=self._pool)
        try:
            found = client.scan_iter(match=pattern, count=_CLEAR_BATCH)
            for batch in batched(found, _CLEAR_BATCH):
                unlinked += client.unlink(*batch)
        except RedisError as err:
            raise RuntimeError(
                f"redis backend: clear() at {self.config.address} failed after "
                f"{unlinked} keys: {err}"
            ) from err
        logger.info("redis backend: clear() unlinked %d keys matching %r at %s",
                    unlinked, pattern, self.config.address)

    def stats(self) -> dict[str, float]:
        return self._counts.snapshot()

    def take_removed_keys(self) -> list[str]:
        """Keys the server evicted or expired since the last call (removals.py)."""
        return self._watcher.take() if self._watcher is not None else []

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._watcher is not None:
            self._watcher.close()
        if self._pool is not None:
            self._pool.disconnect()
        if self._cluster is not None:
            self._cluster.close()

    # --- helpers ---

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def _chunks(self, sizes: list[int]) -> Iterator[range]:
        """Consecutive index ranges of at most batch_size keys and batch_bytes
        bytes (a single bigger object is a chunk of its own)."""
        return chunks(sizes, max_items=self.config.batch_size, max_bytes=self.config.batch_bytes)

    @property
    def _address(self) -> str:
        return self._cluster.address if self._cluster is not None else self.config.address

    def _exchange(self, op: str, names: list[bytes],
                  pack: Callable[[Sequence[int]], list]) -> list[Any] | None:
        """One reply per key of ``names``; ``pack(indices)`` puts those keys'
        commands on the wire. None: the server could not be reached. In a
        cluster a key whose master could not answer has the reply None."""
        if self._cluster is not None:
            return self._cluster.exchange(op, names, pack)
        return self._roundtrip(op, pack(range(len(names))), len(names))

    def _roundtrip(self, op: str, chunks: list, count: int) -> list[Any] | None:
        """One packed pipeline of ``count`` commands on a pooled connection; its
        replies, error replies in place. None: the server could not be reached
        (or this backend is closed)."""
        if self._closed or self._pool is None:
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

    def _note_failure(self, op: str, err: Exception) -> None:
        self._counts.add(errors=1)
        with self._lock:
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


def _keyed(command: bytes, names: list[bytes]) -> Callable[[Sequence[int]], list]:
    """The packer of ``command key`` for a subset of ``names``."""
    return lambda idx: pack_keyed(command, [names[i] for i in idx])


def _sets(names: list[bytes], values: list[Buffers]) -> Callable[[Sequence[int]], list]:
    """The packer of ``SET key value`` for a subset of ``names``."""
    return lambda idx: pack_sets([names[i] for i in idx], [values[i] for i in idx])


def _scatter(value: Any, bufs: Buffers, total: int) -> bool:
    """Copy one GET reply into the caller's buffers if it is exactly their size."""
    if not isinstance(value, bytes) or len(value) != total:
        return False
    scatter(np.frombuffer(value, np.uint8), bufs)
    return True


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
