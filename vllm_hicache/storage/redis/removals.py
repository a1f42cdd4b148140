"""Keys the Redis server evicted or expired, heard through keyspace
notifications, for exact L3 removal events (l3/removals.py).

Redis evicts on its own (``maxmemory``): nothing in our calls says which
objects left. With ``notify-keyspace-events`` holding ``E`` (keyevent
channels) and ``e`` and ``x`` (evicted, expired; ``A`` includes both), the
server publishes each such key on ``__keyevent@<db>__:evicted`` and
``...:expired``. ``KeyspaceWatcher`` subscribes on a connection of its own,
in a daemon thread, and keeps the keys under ``key_prefix`` (the prefix
stripped: the backend's object keys) until ``take`` (bounded,
``MAX_KEYS``: beyond, the oldest are dropped and counted).

Exact only while subscribed: Pub/Sub is at most once, so a key evicted while
the connection is down (it reconnects every ``RECONNECT_S``) is never told,
nor one evicted by a server whose ``notify-keyspace-events`` lacks the
flags (checked at start: a warning names the setting; we never change the
server's configuration).
"""

from __future__ import annotations

import collections
import logging
import threading

import redis
from redis.exceptions import RedisError

from vllm_hicache.io_threads import named_thread
from vllm_hicache.storage.redis.config import RedisConfig

logger = logging.getLogger(__name__)

# Keys waiting for take(), at most.
MAX_KEYS = 1 << 16
# Wait between attempts to (re)subscribe.
RECONNECT_S = 1.0
# A get_message wait: how soon close() is noticed.
_POLL_S = 0.5
EVENTS = ("evicted", "expired")


def notifies_removals(flags: str) -> bool:
    """Does a ``notify-keyspace-events`` value publish evicted and expired
    keys on the keyevent channels?"""
    return "E" in flags and ("A" in flags or ("e" in flags and "x" in flags))


class KeyspaceWatcher:
    def __init__(self, cfg: RedisConfig, prefix: bytes, max_keys: int = MAX_KEYS) -> None:
        self._prefix = prefix
        self._client = redis.Redis.from_url(
            cfg.url, password=cfg.password, socket_connect_timeout=cfg.connect_timeout_s,
            socket_timeout=cfg.socket_timeout_s, **cfg.connection_kwargs())
        db = self._client.connection_pool.connection_kwargs.get("db", 0)
        self._channels = [f"__keyevent@{db}__:{event}" for event in EVENTS]
        self._address = cfg.address
        self._lock = threading.Lock()
        self._keys: collections.deque[str] = collections.deque(maxlen=max_keys)
        self.dropped = 0
        # Whether the server said it notifies removals (None: it did not say).
        self.server_notifies: bool | None = None
        self.subscribed = threading.Event()
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "hicache-redis-events")
        self._thread.start()

    def take(self) -> list[str]:
        with self._lock:
            keys = list(self._keys)
            self._keys.clear()
        return keys

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_S + 1.0)
        self._client.close()

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                if self.server_notifies is None:
                    self._check_server()
                pubsub.subscribe(*self._channels)
                self.subscribed.set()
                warned = False
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=_POLL_S)
                    if message is not None and message.get("type") == "message":
                        self._note(message["data"])
            except (RedisError, OSError) as err:
                self.subscribed.clear()
                if not warned:  # once per outage
                    logger.warning("redis backend: keyspace notifications from %s lost (%r); "
                                   "L3 removals in the meantime are not announced",
                                   self._address, err)
                    warned = True
                self._stop.wait(RECONNECT_S)
            finally:
                pubsub.close()

    def _check_server(self) -> None:
        try:
            flags = self._client.config_get("notify-keyspace-events").get(
                "notify-keyspace-events", "")
        except RedisError:  # CONFIG may be forbidden (ACL, managed Redis): just listen
            return
        flags = flags.decode() if isinstance(flags, bytes) else str(flags or "")
        self.server_notifies = notifies_removals(flags)
        if not self.server_notifies:
            logger.warning(
                "redis backend: %s has notify-keyspace-events=%r, so the keys it evicts or "
                "expires are not announced as KV events (STORAGE removals are hints); set "
                "notify-keyspace-events to include Exe to make them exact", self._address, flags)

    def _note(self, data: bytes | str) -> None:
        raw = data if isinstance(data, bytes) else data.encode()
        if not raw.startswith(self._prefix):
            return
        key = raw[len(self._prefix):].decode(errors="replace")
        with self._lock:
            if len(self._keys) == self._keys.maxlen:
                self.dropped += 1
            self._keys.append(key)
