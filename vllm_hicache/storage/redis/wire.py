"""Connections and RESP2 pipelines of the redis backend; puts copy no payload.

A pipeline is packed here into a list of chunks that redis-py's
``Connection.send_packed_command`` sends one ``sendall`` each, then its
replies are read back one ``read_response`` each (what redis-py's own
Pipeline does). We pack ourselves for SET: redis-py would need each value
as one ``bytes`` (a join: one copy of every object) and, with hiredis
installed, its packer copies every value once more. Here the small pieces
(command heads, keys, the 64-byte object header) are gathered into one bytes
and each large buffer goes out as a memoryview of the caller's memory, so a
put copies no payload byte in Python.

    SET:  *3 CRLF $3 CRLF SET CRLF $<len key> CRLF <key> CRLF $<len object> CRLF
          <buffer 0> <buffer 1> ... CRLF          (the buffers, back to back, are the value)

Connections come from one blocking pool per backend (threads wait for a free
one up to socket_timeout_s). The constructor's probe uses its own client with
bounded timeouts so that a failing start ends within 30 s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from vllm_hicache.storage.base import Buffers
from vllm_hicache.storage.redis.config import RedisConfig

# Buffers shorter than this are copied into the gathered bytes: one sendall
# per 64-byte header would cost more than the copy.
_INLINE_MAX = 16 * 1024
_CRLF = b"\r\n"
# The startup probe's read bound: a server that accepts but never answers must
# not hold vLLM's start for the full socket_timeout_s.
_PROBE_READ_TIMEOUT_S = 5.0
_PROBE_INTERVAL_S = 0.2


class _Gather:
    """Chunks for sendall: small pieces joined, large buffers by reference."""

    def __init__(self) -> None:
        self.chunks: list[bytes | memoryview] = []
        self._small = bytearray()

    def add(self, data: bytes | memoryview) -> None:
        if len(data) < _INLINE_MAX:
            self._small += data
            return
        if self._small:
            self.chunks.append(bytes(self._small))
            self._small.clear()
        self.chunks.append(data)

    def done(self) -> list[bytes | memoryview]:
        if self._small:
            self.chunks.append(bytes(self._small))
        return self.chunks


def pack_keyed(command: bytes, keys: Sequence[bytes]) -> list[bytes]:
    """``command key`` once per key (GET, EXISTS), as one chunk."""
    head = b"*2\r\n$%d\r\n%s\r\n" % (len(command), command)
    return [b"".join(b"%s$%d\r\n%s\r\n" % (head, len(k), k) for k in keys)]


def pack_sets(keys: Sequence[bytes], sources: Sequence[Buffers]) -> list[bytes | memoryview]:
    """``SET key <buffers concatenated>`` once per key."""
    out = _Gather()
    for key, bufs in zip(keys, sources):
        views = [memoryview(buf).cast("B") for buf in bufs]
        total = sum(v.nbytes for v in views)
        out.add(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, total))
        for view in views:
            out.add(view)
        out.add(_CRLF)
    return out.done()


def exchange(conn: Any, chunks: Sequence[bytes | memoryview], count: int) -> list[Any]:
    """Send one packed pipeline of ``count`` commands and read every reply; an
    error reply (OOM, WRONGTYPE) is returned as its ResponseError, in place.
    A connection error or timeout raises (redis-py has then closed ``conn``)."""
    conn.send_packed_command(chunks, check_health=False)
    return read_replies(conn, count)


def read_replies(conn: Any, count: int) -> list[Any]:
    """The next ``count`` replies on ``conn``, error replies in place (as in
    exchange): the second half of a pipeline sent earlier."""
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(conn.read_response())
        except ResponseError as err:
            replies.append(err)
    return replies


# --- connections ---


def make_pool(cfg: RedisConfig, url: str | None = None) -> redis.BlockingConnectionPool:
    # ``url``: a cluster node's (cluster.py), reached with cfg's other options.
    # The pool replaces a connection the server closed before handing it out;
    # one immediate retry covers one that breaks in use. None on timeouts:
    # that would double what a hung server costs.
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    return redis.BlockingConnectionPool.from_url(
        url or cfg.url, password=cfg.password, socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=cfg.connect_timeout_s, max_connections=cfg.max_connections,
        timeout=cfg.socket_timeout_s, retry=retry, **cfg.connection_kwargs(),
    )


def probe_server(cfg: RedisConfig) -> None:
    """PING until it answers or startup_wait_s has passed; then raise
    ConnectionError naming the backend and the address (never the password)."""
    probe = redis.Redis.from_url(
        cfg.url, password=cfg.password, socket_connect_timeout=cfg.connect_timeout_s,
        socket_timeout=min(cfg.socket_timeout_s, _PROBE_READ_TIMEOUT_S),
        retry=Retry(NoBackoff(), 0), **cfg.connection_kwargs(),
    )
    deadline = time.monotonic() + cfg.startup_wait_s
    try:
        while True:
            try:
                probe.ping()
                _refuse_cluster_node(probe, cfg)
                return
            except (AuthenticationError, ResponseError) as err:
                raise ConnectionError(
                    f"redis backend: the server at {cfg.address} refused us: {err}"
                ) from err
            except (RedisError, OSError) as err:
                if time.monotonic() + _PROBE_INTERVAL_S > deadline:
                    raise ConnectionError(
                        f"redis backend: cannot reach the server at {cfg.address} "
                        f"(tried for {cfg.startup_wait_s:g} s): {err}"
                    ) from err
            time.sleep(_PROBE_INTERVAL_S)
    finally:
        probe.close()


def _refuse_cluster_node(probe: redis.Redis, cfg: RedisConfig) -> None:
    """A cluster node reached as a single server would answer MOVED for most
    keys (misses, writes taken for rejected): say at start what to set. A
    user not allowed INFO is not checked."""
    try:
        enabled = probe.info("cluster").get("cluster_enabled")
    except ResponseError:
        return
    if enabled == 1:
        raise ValueError(f"redis backend: the server at {cfg.address} is a Redis Cluster node; "
                         "set the option cluster: true")
