"""The redis backend against a real local Redis Cluster (cluster_services.py:
three masters, three replicas, a password on every node), shared by this
module: conformance, batches across every master, hash slots as the server
computes them, ASK and MOVED around a manual slot migration, a hung master,
and last (it leaves one master without a replica) a master SIGKILLed mid-run."""

from __future__ import annotations

import threading
import time

import pytest

from tests.storage.conformance import BackendConformance, empty, keys, make, obj, same
from tests.storage.redis.cluster_services import LocalCluster
from tests.storage.redis.services import RedisServer
from vllm_hicache.storage.redis.slots import key_slot

pytestmark = pytest.mark.timeout(240)

PASSWORD = "cluster-pw-0123"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(tmp_path_factory.mktemp("redis-cluster"), password=PASSWORD).start()
    yield local
    local.kill()


def options(cluster: LocalCluster, **extra) -> dict:
    return {"url": cluster.seed_url, "cluster": True, "password": PASSWORD, **extra}


class TestClusterConformance(BackendConformance):
    @pytest.fixture
    def spec(self, cluster):
        return "redis", options(cluster, key_prefix="conf:")

    @pytest.fixture
    def backend(self, spec):
        b = make(spec)
        yield b
        b.close()


def test_slots_agree_with_the_server(cluster):
    client = cluster.client(cluster.masters()[0])
    try:
        for key in (b"hicache:hc4-abc", b"{tag}x", b"a{b}c", b"", b"\xff\x00binary"):
            assert key_slot(key) == client.execute_command("CLUSTER", "KEYSLOT", key)
    finally:
        client.close()


def test_batches_span_every_master(cluster):
    b = make(("redis", options(cluster, key_prefix="span:", batch_size=16)))
    try:
        ks = keys(120)
        objs = [obj(i) for i in range(120)]
        assert b.put(ks, objs) == [True] * 120
        homes = {cluster.master_of(b"span:" + k.encode()) for k in ks}
        assert homes == set(cluster.masters())
        absent = keys(1)[0]
        assert b.exists_prefix(ks) == 120
        assert b.exists_prefix([*ks[:50], absent, *ks[50:]]) == 50
        targets = [empty() for _ in ks]
        assert b.get([*ks, absent], [*targets, empty()]) == [True] * 120 + [False]
        assert all(same(t, o) for t, o in zip(targets, objs))
        stats = b.stats()
        assert stats["errors"] == 0 and stats["redirects"] == 0
    finally:
        b.close()


def test_closed_backend_misses(cluster):
    b = make(("redis", options(cluster, key_prefix="closed:")))
    ks = keys(6)
    assert b.put(ks, [obj(i) for i in range(6)]) == [True] * 6
    b.close()
    b.close()
    assert b.exists_prefix(ks) == 0
    assert b.get(ks, [empty() for _ in ks]) == [False] * 6
    assert b.put(ks, [obj(i) for i in range(6)]) == [False] * 6


def test_a_single_server_config_on_a_cluster_node_is_refused(cluster):
    with pytest.raises(ValueError, match="Redis Cluster node; set the option cluster: true"):
        make(("redis", {"url": cluster.seed_url, "password": PASSWORD}))


def test_cluster_mode_on_a_plain_server_is_refused(tmp_path):
    srv = RedisServer(tmp_path / "plain").start()
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="not a cluster node") as err:
            make(("redis", {"url": srv.url, "cluster": True}))
        assert time.monotonic() - start < 5
        assert str(srv.port) in str(err.value)
    finally:
        srv.kill()


def test_wrong_password_is_refused_without_showing_it(cluster):
    with pytest.raises(ConnectionError, match="refused us") as err:
        make(("redis", {**options(cluster), "password": "wrong-secret"}))
    assert "wrong-secret" not in str(err.value) and PASSWORD not in str(err.value)


def test_unreachable_seeds_are_a_clear_error():
    from tests.ports import free_ports

    a, c = free_ports(2)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot reach any seed") as err:
        make(("redis", {"url": f"redis://127.0.0.1:{a}", "cluster": True,
                        "cluster_nodes": [f"127.0.0.1:{c}"], "startup_wait_s": 0.5}))
    assert time.monotonic() - start < 5
    assert f"127.0.0.1:{a}" in str(err.value) and f"127.0.0.1:{c}" in str(err.value)


def test_a_dead_seed_is_skipped_for_the_next(cluster):
    from tests.ports import free_port

    dead = free_port()
    b = make(("redis", {**options(cluster), "url": f"redis://127.0.0.1:{dead}",
                        "cluster_nodes": [f"127.0.0.1:{cluster.servers[1].port}"]}))
    try:
        ks = keys(8)
        assert b.put(ks, [obj(i) for i in range(8)]) == [True] * 8
    finally:
        b.close()


# --- a slot migrated by hand: ASK while it moves, MOVED once it has ---------------


def key_in_slot(slot: int, prefix: bytes, tag: str) -> str:
    """A backend key whose stored name (prefix + key) hashes to ``slot``."""
    for i in range(1_000_000):
        key = f"hc1-{tag}-{i}"
        if key_slot(prefix + key.encode()) == slot:
            return key
    raise AssertionError(f"no key found for slot {slot}")


def node_id(cluster: LocalCluster, port: int) -> str:
    client = cluster.client(port)
    try:
        return client.execute_command("CLUSTER", "MYID").decode()
    finally:
        client.close()


def test_ask_during_a_migration_then_moved_after_it(cluster):
    prefix = b"mig:"
    b = make(("redis", options(cluster, key_prefix=prefix.decode())))
    clients = {}
    try:
        moving = keys(1)[0]
        slot = key_slot(prefix + moving.encode())
        src = cluster.master_of(prefix + moving.encode())
        dst = next(p for p in cluster.masters() if p != src)
        staying = key_in_slot(slot, prefix, "staying")
        assert b.put([moving, staying], [obj(1), obj(2)]) == [True, True]
        clients = {p: cluster.client(p) for p in (src, dst)}
        src_id, dst_id = node_id(cluster, src), node_id(cluster, dst)
        clients[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        clients[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        clients[src].execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000,
                                     "AUTH", PASSWORD, "KEYS", prefix + moving.encode())
        # Mid-migration: the moved key is answered ASK by the source; a new key
        # of the slot too (the source has not got it), so it lands on dst.
        targets = [empty(), empty()]
        assert b.get([moving, staying], targets) == [True, True]
        assert same(targets[0], obj(1)) and same(targets[1], obj(2))
        new = key_in_slot(slot, prefix, "new")
        assert b.put([new], [obj(3)]) == [True]
        assert b.exists_prefix([moving, staying, new]) == 3
        asked = b.stats()["redirects"]
        assert asked >= 3
        clients[src].execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000,
                                     "AUTH", PASSWORD, "KEYS", prefix + staying.encode())
        for port in (dst, src):
            clients[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        # Done: the source answers MOVED; the backend follows, then goes
        # straight to dst (the move is recorded in its map).
        targets = [empty() for _ in range(3)]
        assert b.get([moving, staying, new], targets) == [True] * 3
        assert all(same(t, obj(i + 1)) for i, t in enumerate(targets))
        assert b.stats()["redirects"] > asked
        moved = b.stats()["redirects"]
        assert b.get([moving], [empty()]) == [True]
        assert b.stats()["redirects"] == moved
        assert b.stats()["errors"] == 0
    finally:
        for client in clients.values():
            client.close()
        b.close()
    cluster.wait_healthy(30)


def test_hung_master_costs_one_timeout_then_is_skipped(cluster):
    """A paused master (shorter than the cluster's failover timeout): its
    keys miss, the other masters' keys hit in the same call, and the next
    call does not wait for it again; once it answers, it is used again."""
    b = make(("redis", options(cluster, key_prefix="hang:", socket_timeout_s=0.5,
                               connect_timeout_s=0.5)))
    try:
        ks = keys(30)
        assert b.put(ks, [obj(i) for i in range(30)]) == [True] * 30
        homes = [cluster.master_of(b"hang:" + k.encode()) for k in ks]
        victim = cluster.node(homes[0])
        expected = [home != victim.port for home in homes]
        targets = [empty() for _ in ks]
        victim.pause()
        try:
            start = time.monotonic()
            first = b.get(ks, targets)
            first_s = time.monotonic() - start
            start = time.monotonic()
            second = b.get(ks, [empty() for _ in ks])
            second_s = time.monotonic() - start
        finally:
            victim.resume()
        assert first == expected and second == expected
        assert all(same(targets[i], obj(i)) for i in range(30) if expected[i])
        assert first_s < 2.0 and second_s < 0.45, (first_s, second_s)
        deadline = time.monotonic() + 15  # skipped for a second, then tried again
        while b.get(ks, [empty() for _ in ks]) != [True] * 30:
            assert time.monotonic() < deadline, "the resumed master is not used again"
            time.sleep(0.2)
    finally:
        b.close()
    cluster.wait_healthy(30)


# --- last: a master SIGKILLed mid-run ----------------------------------------------


def test_master_killed_mid_run_costs_misses_then_recovers(cluster, caplog):
    """A writer-reader loop runs while a master is killed: no call raises or
    hangs, no read returns wrong bytes; once the replica is promoted, writes
    land on it and reads return them."""
    caplog.set_level("INFO", logger="vllm_hicache.storage.redis")
    prefix = b"fo:"
    b = make(("redis", options(cluster, key_prefix=prefix.decode(), socket_timeout_s=0.5,
                               connect_timeout_s=0.5, batch_size=16)))
    ks = keys(60)
    homes = [cluster.master_of(prefix + k.encode()) for k in ks]
    victim = homes[0]
    victim_keys = [i for i, h in enumerate(homes) if h == victim]
    log: list[tuple[float, str, list[bool]]] = []
    problems: list[str] = []
    stop = threading.Event()

    def run() -> None:
        try:
            while not stop.is_set():
                start = time.monotonic()
                stored = b.put(ks, [obj(i) for i in range(len(ks))])
                log.append((time.monotonic() - start, "put", stored))
                targets = [empty() for _ in ks]
                start = time.monotonic()
                hits = b.get(ks, targets)
                log.append((time.monotonic() - start, "get", hits))
                problems.extend(f"key {i} read back wrong bytes" for i, hit in enumerate(hits)
                                if hit and not same(targets[i], obj(i)))
        except Exception as err:  # noqa: BLE001 - reported by the assert below
            problems.append(f"{type(err).__name__}: {err}")

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        time.sleep(1.0)
        assert log and all(all(ok) for _, _, ok in log), "not healthy before the kill"
        before_kill = len(log)
        masters_before = cluster.kill_master(victim)
        promoted = cluster.wait_promoted(masters_before, timeout_s=60)
        # After the promotion: writes and reads of the victim's keys work again.
        deadline = time.monotonic() + 30
        recovered = len(log)
        while time.monotonic() < deadline and not problems:
            time.sleep(0.2)
            after = log[recovered:]
            if sum(1 for _, op, ok in after if op == "get" and all(ok)) >= 2:
                break
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not worker.is_alive(), "the loop hung"
    assert not problems, problems[:5]
    during = log[before_kill:]
    assert any(not all(ok) for _, _, ok in during), "the kill cost no miss at all?"
    assert all(all(ok[i] for i in range(len(ks)) if i not in victim_keys)
               for _, op, ok in during if op == "get" and all(ok[j] for j in victim_keys)), \
        "a read that reached every master missed a key"
    assert sum(1 for _, op, ok in log[recovered:] if op == "get" and all(ok)) >= 2, \
        "did not recover within 30 s of the promotion"
    # Bounded: a call during the outage costs at most a few socket timeouts.
    assert max(t for t, _, _ in during) < 5.0
    # The promoted replica holds the victim's keys with the right bytes.
    raw = cluster.client(promoted)
    try:
        for i in victim_keys:
            value = raw.get(prefix + ks[i].encode())
            assert value == b"".join(x.tobytes() for x in obj(i))
    finally:
        raw.close()
    stats = b.stats()
    assert stats["errors"] > 0 and stats["topology_refreshes"] >= 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"127.0.0.1:{victim}" in w for w in warnings)
    assert any(f"127.0.0.1:{promoted}" in r.getMessage() for r in caplog.records
               if "masters now" in r.getMessage())
    b.close()
