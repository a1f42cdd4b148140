"""The redis L3 backend against real redis-server processes (services.py):
conformance over TCP and a unix socket, then what only a networked store shows:
outages (killed, hung, restarted server), eviction, a full server, auth, an
unreachable server at start, and a clear() that touches only our keys."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.storage.conformance import BackendConformance, empty, keys, make, obj, same
from tests.storage.redis.services import RedisServer, free_port
from vllm_hicache.storage.redis.config import RedisConfig

pytestmark = pytest.mark.timeout(180)

# An object larger than the conformance one, so a few fill a small maxmemory.
BIG = 64 * 1024


def big_obj(seed: int) -> list[np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, 64 + BIG, dtype=np.uint8)
    return [data[:64].copy(), data[64:].copy()]


def big_empty() -> list[np.ndarray]:
    return [np.zeros(64, np.uint8), np.zeros(BIG, np.uint8)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis-main"), "--maxmemory", "256mb",
                      "--maxmemory-policy", "allkeys-lru").start()
    yield srv
    srv.kill()


@pytest.fixture
def own_server(tmp_path):
    """A server this test may kill, pause or fill."""
    servers: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        servers.append(RedisServer(tmp_path / f"redis-{len(servers)}", *args).start())
        return servers[-1]

    yield start
    for srv in servers:
        srv.kill()


class TestRedisConformance(BackendConformance):
    @pytest.fixture(params=["tcp", "unix"])
    def spec(self, request, server):
        url = server.url if request.param == "tcp" else server.unix_url
        return "redis", {"url": url, "key_prefix": "conf:"}

    @pytest.fixture
    def backend(self, spec):
        b = make(spec)
        yield b
        b.close()


@pytest.mark.parametrize("options, match", [
    ({}, "url"),
    ({"url": "redis://h", "batch_size": 0}, "batch_size"),
    ({"url": "redis://h", "socket_timeout_s": "2"}, "socket_timeout_s"),
    ({"url": "redis://h", "key_prefix": ""}, "key_prefix"),
    ({"url": "http://h"}, "scheme"),
    ({"url": "redis://h?socket_timeout=3"}, "socket_timeout"),
    ({"url": "redis://h", "bogus": 1}, "accepted: .*batch_size"),
])
def test_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        RedisConfig.from_options(options)


def test_password_never_shown():
    with pytest.raises(ValueError, match="password") as err:
        RedisConfig.from_options({"url": "redis://:hunter2@127.0.0.1:1/0"})
    assert "hunter2" not in str(err.value)
    cfg = RedisConfig.from_options({"url": "redis://127.0.0.1:1/0", "password": "hunter2"})
    assert "hunter2" not in repr(cfg) and "hunter2" not in cfg.address
    assert RedisConfig.from_options({"url": "unix:///tmp/x.sock?db=2"}).batch_size == 128


@pytest.mark.parametrize("url, problem", [
    ("redis://alice:hunter2@h:1/0", "it contains a password"),
    ("redis://h:1/0?password=hunter2", r"query argument\(s\) \['password'\]"),
    ("redis://h:1/0?db=1&auth=hunter2", r"query argument\(s\) \['auth'\]"),
    ("http://u:hunter2@h/?password=hunter2", "Redis URL must specify one of the .*schemes"),
    ("redis://h:hunter2/0", "the port is not an integer"),
])
def test_url_errors_never_echo_a_password(url, problem):
    """A wrong URL is named in the error with its password and query values
    redacted (they may be the secret)."""
    with pytest.raises(ValueError, match=f"invalid redis backend option url='.*': {problem}") \
            as err:
        RedisConfig.from_options({"url": url})
    assert "hunter2" not in str(err.value)


def test_clear_deletes_only_our_prefix(server):
    ours = make(("redis", {"url": server.url, "key_prefix": "mine:"}))
    theirs = make(("redis", {"url": server.url, "key_prefix": "theirs:"}))
    raw = server.client()
    try:
        ks = keys(3)
        ours.put(ks, [obj(i) for i in range(3)])
        theirs.put(ks, [obj(i) for i in range(3)])
        raw.set("unrelated-key", b"x")
        ours.clear()
        assert ours.exists_prefix(ks) == 0
        assert theirs.exists_prefix(ks) == 3
        assert raw.get("unrelated-key") == b"x"
    finally:
        raw.delete("unrelated-key")
        ours.close(), theirs.close(), raw.close()


def test_small_batches_and_stats(server):
    b = make(("redis", {"url": server.url, "batch_size": 3, "batch_bytes": 10_000}))
    try:
        ks, objs = keys(10), [obj(i) for i in range(10)]
        present = [i for i in range(10) if i != 7]
        assert b.put([ks[i] for i in present], [objs[i] for i in present]) == [True] * 9
        assert b.exists_prefix(ks) == 7
        targets = [empty() for _ in ks]
        assert b.get(ks, targets) == [i != 7 for i in range(10)]
        assert all(same(targets[i], objs[i]) for i in present)
        stats = b.stats()
        assert stats["put_ok"] == 9 and stats["get_hits"] == 9 and stats["errors"] == 0
        assert stats["bytes_read"] == 9 * sum(x.nbytes for x in objs[0])
    finally:
        b.close()


def test_any_buffer_split_round_trips(server):
    """The value is the buffers back to back, whatever their sizes: small ones
    are inlined into the command bytes, large ones sent from their memory."""
    b = make(("redis", {"url": server.url}))
    try:
        data = np.random.default_rng(5).integers(0, 256, 64 + 100 + 40_000 + 1, dtype=np.uint8)
        splits = {"one": [data.copy()], "many": np.split(data.copy(), [64, 164, 40_164])}
        ks = keys(2)
        assert b.put(ks, [splits["one"], splits["many"]]) == [True, True]
        targets = [np.split(np.zeros_like(data), [64]), [np.zeros_like(data)]]
        assert b.get(ks, targets) == [True, True]
        assert all(np.array_equal(np.concatenate(t), data) for t in targets)
    finally:
        b.close()


def test_closed_backend_misses(server):
    b = make(("redis", {"url": server.url}))
    ks = keys(1)
    assert b.put(ks, [obj(0)]) == [True]
    b.close()
    b.close()
    assert b.exists_prefix(ks) == 0
    assert b.get(ks, [empty()]) == [False]
    assert b.put(ks, [obj(0)]) == [False]


def test_more_threads_than_connections(server):
    b = make(("redis", {"url": server.url, "max_connections": 2}))
    results: list[bool] = []

    def work(seed: int) -> None:
        ks, objs = keys(4), [obj(seed * 10 + i) for i in range(4)]
        ok = b.put(ks, objs) == [True] * 4
        targets = [empty() for _ in ks]
        ok &= b.get(ks, targets) == [True] * 4
        results.append(ok and all(same(t, o) for t, o in zip(targets, objs)))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    b.close()
    assert results == [True] * 8


def test_killed_server_costs_bounded_misses_then_recovers(own_server, caplog):
    srv = own_server()
    b = make(("redis", {"url": srv.url, "socket_timeout_s": 1.0}))
    caplog.set_level("INFO", logger="vllm_hicache.storage.redis")
    try:
        ks = keys(4)
        assert b.put(ks, [obj(i) for i in range(4)]) == [True] * 4
        srv.kill()
        for call in (lambda: b.exists_prefix(ks), lambda: b.get(ks, [empty() for _ in ks]),
                     lambda: b.put(ks, [obj(i) for i in range(4)])):
            start = time.monotonic()
            assert call() in (0, [False] * 4)
            assert time.monotonic() - start < 2.5
        srv.start()  # same port, empty (no persistence)
        assert b.exists_prefix(ks) == 0
        assert b.put(ks, [obj(i) for i in range(4)]) == [True] * 4
        targets = [empty() for _ in ks]
        assert b.get(ks, targets) == [True] * 4
        assert all(same(t, obj(i)) for i, t in enumerate(targets))
        assert b.stats()["errors"] >= 3
        # One warning for the outage (not one per call), one line for the recovery.
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and srv.url in warnings[0].getMessage()
        assert any("answers again" in r.getMessage() for r in caplog.records)
        srv.kill()
        srv.start()  # no call in between: the pooled connection is stale
        assert b.put(ks, [obj(i) for i in range(4)]) == [True] * 4
    finally:
        b.close()


def test_hung_server_costs_one_timeout_per_call(own_server):
    srv = own_server()
    b = make(("redis", {"url": srv.url, "socket_timeout_s": 0.5, "batch_size": 2}))
    try:
        ks = keys(6)
        assert b.put(ks, [obj(i) for i in range(6)]) == [True] * 6
        srv.pause()
        try:
            start = time.monotonic()
            assert b.get(ks, [empty() for _ in ks]) == [False] * 6  # 3 chunks, one wait
            assert time.monotonic() - start < 1.5
        finally:
            srv.resume()
        targets = [empty() for _ in ks]
        assert b.get(ks, targets) == [True] * 6
        assert all(same(t, obj(i)) for i, t in enumerate(targets))
    finally:
        b.close()


def test_lru_eviction_gives_misses_never_wrong_bytes(own_server):
    srv = own_server("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    b = make(("redis", {"url": srv.url, "batch_size": 8}))
    try:
        ks = keys(200)  # 13 MB into 4 MB
        for start in range(0, 200, 20):
            assert b.put(ks[start:start + 20], [big_obj(i) for i in range(start, start + 20)]) \
                == [True] * 20
        targets = [big_empty() for _ in ks]
        hits = b.get(ks, targets)
        assert 0 < sum(hits) < 200 and not hits[0]
        assert all(same(targets[i], big_obj(i)) for i in range(200) if hits[i])
        assert b.exists_prefix(ks) == 0
        assert int(srv.client().info("stats")["evicted_keys"]) > 0
    finally:
        b.close()


def test_full_server_rejects_puts_reads_stay_correct(own_server):
    srv = own_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    b = make(("redis", {"url": srv.url}))
    try:
        ks = keys(80)  # 5 MB into 2 MB
        stored = b.put(ks, [big_obj(i) for i in range(80)])
        assert stored[0] and not stored[-1]
        assert b.stats()["put_rejected"] == stored.count(False)
        targets = [big_empty() for _ in ks]
        assert b.get(ks, targets) == stored
        assert all(same(targets[i], big_obj(i)) for i in range(80) if stored[i])
    finally:
        b.close()


def test_password_auth(own_server):
    srv = own_server("--requirepass", "s3cret-pw")
    good = make(("redis", {"url": srv.unix_url, "password": "s3cret-pw"}))
    try:
        ks = keys(1)
        assert good.put(ks, [obj(0)]) == [True]
        assert good.exists_prefix(ks) == 1
    finally:
        good.close()
    for options in ({"password": "wrong-pw"}, {}):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="redis backend") as err:
            make(("redis", {"url": srv.url, **options}))
        assert time.monotonic() - start < 5
        assert srv.url in str(err.value) and "pw" not in str(err.value)


def test_unreachable_at_start_is_a_clear_error(tmp_path):
    port = free_port()
    for url, wait in ((f"redis://127.0.0.1:{port}/0", 1.0), (f"unix://{tmp_path}/none.sock", 0.0)):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="redis backend") as err:
            make(("redis", {"url": url, "startup_wait_s": wait}))
        assert time.monotonic() - start < wait + 5
        assert url in str(err.value)
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        make(("redis", {"url": f"redis://127.0.0.1:{port}/0"}))  # defaults
    assert time.monotonic() - start < 30


def test_server_starting_late_is_waited_for(tmp_path):
    srv = RedisServer(tmp_path / "late")
    timer = threading.Timer(1.0, srv.start)
    timer.start()
    try:
        b = make(("redis", {"url": srv.url, "startup_wait_s": 10.0}))
        ks = keys(1)
        assert b.put(ks, [obj(0)]) == [True]
        b.close()
    finally:
        timer.join(timeout=20)
        srv.kill()


def test_keys_the_server_evicts_are_told_exactly(own_server):
    """With maxmemory and keyspace notifications on, the scheduler's client
    hears exactly the objects the server evicted (for KV events)."""
    from vllm_hicache.storage.base import StorageContext
    from vllm_hicache.storage.redis.backend import RedisBackend

    srv = own_server("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru",
                     "--notify-keyspace-events", "Exe")
    opts = {"url": srv.url, "key_prefix": "ev:"}
    listener = RedisBackend(opts, StorageContext("scheduler", 0, 1, 64 + BIG))
    writer = RedisBackend(opts, StorageContext("worker", 0, 1, 64 + BIG))
    try:
        assert listener._watcher.subscribed.wait(10) and listener._watcher.server_notifies
        assert writer.take_removed_keys() == []  # workers do not listen
        ks = [f"k{i:04d}" for i in range(4 * (2 << 20) // BIG)]  # four times maxmemory
        for i in range(0, len(ks), 8):
            writer.put(ks[i:i + 8], [big_obj(j) for j in range(i, min(i + 8, len(ks)))])
        gone = [k for k in ks if not writer.exists_prefix([k])]
        assert gone, "the server evicted nothing"
        told: list[str] = []
        deadline = time.monotonic() + 10
        while set(told) != set(gone) and time.monotonic() < deadline:
            told += listener.take_removed_keys()
            time.sleep(0.05)
        assert sorted(told) == sorted(gone)
    finally:
        listener.close()
        writer.close()


def test_a_server_without_notifications_is_named_once(own_server, caplog):
    from vllm_hicache.storage.base import StorageContext
    from vllm_hicache.storage.redis.backend import RedisBackend
    from vllm_hicache.storage.redis.removals import notifies_removals

    assert notifies_removals("Exe") and notifies_removals("AE") and notifies_removals("KEA")
    assert not any(map(notifies_removals, ("", "Ee", "Kex")))
    srv = own_server()
    with caplog.at_level("WARNING"):
        b = RedisBackend({"url": srv.url}, StorageContext("scheduler", 0, 1, 64 + BIG))
        try:
            assert b._watcher.subscribed.wait(10)
            assert b._watcher.server_notifies is False
        finally:
            b.close()
    assert "notify-keyspace-events" in caplog.text and "Exe" in caplog.text
