"""Redis Cluster routing for the redis backend (``cluster: true``).

The backend hands over one chunk of commands at a time, each on one key
(GET, EXISTS, SET), as key names plus a packer that turns any subset of them
into wire bytes (wire.py). ClusterLink answers one reply per key, in order:

1. Route: each key's hash slot (slots.py) -> that slot's master in the
   current SlotMap snapshot. Keys of one master go out as one pipeline on one
   connection of that master's pool. All pipelines are sent first, then the
   replies read, so the masters work on their parts at the same time.
   Connections are taken in address order, so threads sharing bounded pools
   never wait on each other in a cycle.
2. Redirect: a ``MOVED`` reply re-sends the key to the named master and
   records the move in the snapshot; an ``ASK`` reply re-sends it once to the
   named node behind ``ASKING`` (a slot being migrated; the map keeps its
   owner). At most ``_MAX_ROUNDS`` rounds per chunk.
3. Fail soft: a key whose master cannot be reached (refused, timed out, marked
   down), whose slot has no master in the snapshot, or that is answered
   ``CLUSTERDOWN``/``TRYAGAIN``/``READONLY``, or is still redirected after
   the last round, gets the reply None: a miss for GET and EXISTS, a skipped
   write for SET (a node answering ``LOADING`` counts as unreachable: redis-py
   raises it as a connection error). A connection error is retried once on a fresh
   connection (a server restarted since the connection was pooled); after
   that, or after a timeout, the node is marked down for ``_NODE_DOWN_S``:
   its keys are None at once, so a dead master costs one connect attempt (or
   one ``socket_timeout_s`` if it hangs) per ``_NODE_DOWN_S``, not per call.
4. Refresh: a redirection, a node marked down or a cluster error marks the
   snapshot stale; the next call (at most one per ``_REFRESH_INTERVAL_S``, on
   one thread, the others go on with the old snapshot) asks ``CLUSTER SLOTS``
   of up to ``_REFRESH_TRIES`` live nodes (masters, then replicas, then the
   seeds) and swaps the snapshot in. After a failover that is how the promoted
   replica is found.

Only masters are read and written (no READONLY replica reads: a replica may
lag). Replication is asynchronous, so a write acknowledged just before its
master died may be missing on the promoted replica: a later read of it is a
miss. Never wrong bytes: a SET replaces a value atomically on the master and
replicas apply whole commands.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    MovedError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from vllm_hicache.storage.batching import batched
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.log_throttle import LogThrottle
from vllm_hicache.storage.redis.cluster_options import node_url, seed_addresses, show
from vllm_hicache.storage.redis.config import RedisConfig
from vllm_hicache.storage.redis.slots import Address, SlotMap, key_slot
from vllm_hicache.storage.redis.wire import make_pool, read_replies

logger = logging.getLogger(__name__)

# The cluster's counters in the backend's stats(): MOVED/ASK replies followed,
# and topology snapshots fetched.
CLUSTER_COUNTERS = ("redirects", "topology_refreshes")
Packer = Callable[[Sequence[int]], list[Any]]

# First try + redirections + one retry after a broken connection.
_MAX_ROUNDS = 4
_NODE_DOWN_S = 1.0
_REFRESH_INTERVAL_S = 0.5
_REFRESH_TRIES = 3
_STARTUP_INTERVAL_S = 0.2
_ASKING = b"*1\r\n$6\r\nASKING\r\n"
_CLEAR_BATCH = 1000
# Replies that say "not now" for the whole node or slot: a miss, a refresh.
_TRANSIENT = (ClusterDownError, TryAgainError, ReadOnlyError)


class ClusterRefused(ConnectionError):
    """A seed answered but refused us (auth, not a cluster node): no retrying."""


class ClusterLink:
    """Routes keyed commands to a cluster's masters (module docstring)."""

    def __init__(self, cfg: RedisConfig, counts: Counters) -> None:
        self._cfg = cfg
        self._counts = counts
        self._seeds = seed_addresses(cfg.url, cfg.cluster_nodes)
        self._lock = threading.Lock()  # pools, down marks, failing set
        self._refresh_lock = threading.Lock()
        self._pools: dict[Address, redis.BlockingConnectionPool] = {}
        self._down_until: dict[Address, float] = {}
        # Nodes warned about and not yet seen answering (edge-triggered logs).
        self._failing: set[Address] = set()
        self._cluster_errors_log = LogThrottle()
        self._map = SlotMap.empty()
        self._stale = True
        self._next_refresh = 0.0
        self._closed = False

    @property
    def address(self) -> str:
        return "cluster " + ",".join(show(a) for a in self._seeds)

    # --- start and topology ---

    def discover(self) -> None:
        """Fetch the slot map from the seeds, retrying for startup_wait_s. Raises
        ConnectionError if no seed answered (or one refused us); a cluster
        still missing masters for some slots only warns (those are misses)."""
        deadline = time.monotonic() + self._cfg.startup_wait_s
        last: Exception | None = None
        while True:
            try:
                self._install(self._fetch(self._seeds, start=True))
            except ClusterRefused:
                raise
            except ConnectionError as err:
                last = err
            if self._map.unserved() == 0 or time.monotonic() + _STARTUP_INTERVAL_S > deadline:
                break
            time.sleep(_STARTUP_INTERVAL_S)
        self._stale = self._map.unserved() > 0
        if not self._map.masters():
            raise ConnectionError(
                f"redis backend: cannot reach any seed of {self.address} "
                f"(tried for {self._cfg.startup_wait_s:g} s): {last}") from last
        if self._map.unserved():
            logger.warning("redis backend: %s has no master for %d of 16384 slots yet; their "
                           "keys are misses until one serves them", self.address,
                           self._map.unserved())

    def _fetch(self, candidates: Sequence[Address], *, start: bool = False) -> SlotMap:
        """CLUSTER SLOTS from the first of ``candidates`` that answers."""
        errors = []
        for address in candidates:
            try:
                reply = self._command(address, "CLUSTER", "SLOTS")
                self._counts.add(topology_refreshes=1)
                return SlotMap.from_cluster_slots(reply, address)
            except (AuthenticationError, ResponseError, ValueError) as err:
                if start:
                    raise ClusterRefused(
                        f"redis backend: the node {show(address)} of {self.address} "
                        f"refused us or is not a cluster node (cluster: true needs "
                        f"cluster-enabled yes): {err}") from err
                errors.append(f"{show(address)}: {err}")
            except (RedisError, OSError) as err:
                errors.append(f"{show(address)}: {type(err).__name__}: {err}")
        raise ConnectionError("; ".join(errors) or "no node to ask")

    def _command(self, address: Address, *args: str) -> Any:
        pool = self._pool(address)
        conn = pool.get_connection()
        try:
            conn.send_command(*args, check_health=False)
            return conn.read_response()
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _install(self, snapshot: SlotMap) -> None:
        old = self._map.masters()
        self._map = snapshot
        if snapshot.masters() != old:
            logger.info("redis backend: %s masters now %s", self.address,
                        [show(a) for a in snapshot.masters()])

    def _maybe_refresh(self) -> None:
        if not self._stale or time.monotonic() < self._next_refresh:
            return
        if not self._refresh_lock.acquire(blocking=False):
            return  # another thread refreshes; go on with the old snapshot
        try:
            self._next_refresh = time.monotonic() + _REFRESH_INTERVAL_S
            self._stale = False
            try:
                self._install(self._fetch(self._refresh_candidates()))
            except ConnectionError:
                self._stale = True
        finally:
            self._refresh_lock.release()

    def _refresh_candidates(self) -> list[Address]:
        """Live masters, then the other known nodes, then the seeds; at most
        _REFRESH_TRIES (bounds a refresh's time when nodes hang)."""
        known = [*self._map.masters(), *self._map.nodes, *self._seeds]
        live = [a for a in dict.fromkeys(known) if not self._is_down(a)]
        return live[:_REFRESH_TRIES]

    # --- the data path ---

    def exchange(self, op: str, names: Sequence[bytes], pack: Packer) -> list[Any]:
        """One reply per key of ``names`` (module docstring); None where the
        key's master could not answer."""
        replies: list[Any] = [None] * len(names)
        if self._closed or not names:
            return replies
        self._maybe_refresh()
        slots = [key_slot(name) for name in names]
        pending = {(addr, False): idx for addr, idx in self._map.group(slots).items()}
        retried: set[Address] = set()
        for _ in range(_MAX_ROUNDS):
            if not pending:
                break
            batches = [(addr, ask, idx) for (addr, ask), idx in pending.items()
                       if addr is not None and not self._is_down(addr)]
            if len(batches) < len(pending):
                self._stale = True  # unserved slots or a master marked down
            pending = {}
            moves: dict[int, Address] = {}
            redirected = 0
            for (addr, ask, idx), result in zip(batches, self._send_all(batches, pack)):
                if isinstance(result, Exception):
                    if isinstance(result, RedisConnectionError) and addr not in retried:
                        retried.add(addr)
                        pending.setdefault((addr, ask), []).extend(idx)
                    else:
                        self._mark_down(op, addr, result)
                    continue
                self._note_answer(addr)
                for i, reply in zip(idx, result):
                    if isinstance(reply, AskError):  # MovedError is an AskError too
                        moved = isinstance(reply, MovedError)
                        redirected += 1
                        # An empty host: the node that answered (unknown endpoint type).
                        target = (reply.host or addr[0], reply.port)
                        if moved:
                            moves[slots[i]] = target
                        pending.setdefault((target, not moved), []).append(i)
                    elif isinstance(reply, _TRANSIENT):
                        self._note_transient(op, addr, reply)  # the key stays None
                    else:
                        replies[i] = reply
            self._counts.add(redirects=redirected)
            if moves:
                self._stale = True
                self._map = self._map.moved(moves)
        if pending:  # still redirected after the last round
            self._stale = True
            self._counts.add(errors=1)
        return replies

    def _note_transient(self, op: str, addr: Address, reply: Exception) -> None:
        self._stale = True
        self._counts.add(errors=1)
        if self._cluster_errors_log.ready():
            logger.warning("redis backend: %s: %s at %s answered %s (a failover or a "
                           "resharding in progress?); such keys are misses or skipped "
                           "writes", self.address, op, show(addr), reply)

    def _send_all(self, batches: list[tuple[Address, bool, list[int]]],
                  pack: Packer) -> list[list[Any] | Exception]:
        """Send every batch's pipeline, then read every batch's replies: a
        list of replies per batch, or the exception that ended it."""
        results: list[list[Any] | Exception] = [[] for _ in batches]
        held: dict[int, tuple[redis.BlockingConnectionPool, Any]] = {}
        unread: set[int] = set()
        order = sorted(range(len(batches)), key=lambda b: batches[b][0])
        try:
            for b in order:
                addr, ask, idx = batches[b]
                try:
                    pool = self._pool(addr)
                    conn = pool.get_connection()
                except (RedisError, OSError) as err:
                    results[b] = err
                    continue
                held[b] = (pool, conn)
                unread.add(b)
                try:
                    conn.send_packed_command(_asking(pack, idx) if ask else pack(idx),
                                             check_health=False)
                except (RedisError, OSError) as err:
                    results[b] = err
            for b in order:
                if b not in held or isinstance(results[b], Exception):
                    continue
                addr, ask, idx = batches[b]
                try:
                    got = read_replies(held[b][1], 2 * len(idx) if ask else len(idx))
                except (RedisError, OSError) as err:
                    results[b] = err
                    continue
                unread.discard(b)
                results[b] = got[1::2] if ask else got
        finally:
            for b, (pool, conn) in held.items():
                if b in unread:
                    conn.disconnect()  # replies may be left unread: never reuse it
                pool.release(conn)
        return results

    # --- node health ---

    def _pool(self, address: Address) -> redis.BlockingConnectionPool:
        with self._lock:
            if self._closed:  # a call still running when close() came
                raise RedisConnectionError("the redis backend is closed")
            pool = self._pools.get(address)
            if pool is None:
                pool = make_pool(self._cfg, node_url(self._cfg.url, address))
                self._pools[address] = pool
            return pool

    def _is_down(self, address: Address) -> bool:
        return self._down_until.get(address, 0.0) > time.monotonic()

    def _mark_down(self, op: str, address: Address, err: Exception) -> None:
        self._counts.add(errors=1)
        self._stale = True
        with self._lock:
            self._down_until[address] = time.monotonic() + _NODE_DOWN_S
            first = address not in self._failing
            self._failing.add(address)
        if first:
            logger.warning("redis backend: %s at %s of %s failed (%s: %s); its slots are "
                           "misses and skipped writes until it answers or a replica takes "
                           "over", op, show(address), self.address, type(err).__name__, err)

    def _note_answer(self, address: Address) -> None:
        if address not in self._failing:
            return
        with self._lock:
            was = address in self._failing
            self._failing.discard(address)
            self._down_until.pop(address, None)
        if was:
            logger.info("redis backend: %s of %s answers again", show(address),
                        self.address)

    # --- admin ---

    def clear(self, pattern: str) -> int:
        """UNLINK every key matching ``pattern`` on every master; how many.
        Raises RuntimeError if a slot has no master or a master fails: the
        admin asking for a clear must learn that it did not happen."""
        try:
            self._install(self._fetch(self._refresh_candidates() or self._seeds))
        except ConnectionError as err:
            raise RuntimeError(f"redis backend: clear() at {self.address} failed: "
                               f"{err}") from err
        if self._map.unserved():
            raise RuntimeError(f"redis backend: clear() at {self.address}: "
                               f"{self._map.unserved()} slots have no master")
        unlinked = 0
        for address in self._map.masters():
            client = redis.Redis(connection_pool=self._pool(address))
            try:
                for batch in batched(client.scan_iter(match=pattern, count=_CLEAR_BATCH),
                                     _CLEAR_BATCH):
                    pipe = client.pipeline(transaction=False)
                    for key in batch:  # one key per UNLINK: keys differ in slot
                        pipe.unlink(key)
                    unlinked += sum(pipe.execute())
            except RedisError as err:
                raise RuntimeError(
                    f"redis backend: clear() at {show(address)} of {self.address} failed "
                    f"after {unlinked} keys: {err}") from err
        return unlinked

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
        for pool in pools:
            pool.disconnect()


def _asking(pack: Packer, idx: Sequence[int]) -> list[Any]:
    """The commands of ``idx``, each behind its own ASKING (it covers one command)."""
    out: list[Any] = []
    for i in idx:
        out.append(_ASKING)
        out.extend(pack([i]))
    return out
