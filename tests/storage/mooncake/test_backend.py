"""The mooncake L3 backend against a real mooncake_master + storage daemon.

Services come from services.py, on loopback; run the session in a
private network namespace (Mooncake's transfer engine also listens on all
interfaces). Beyond conformance: option parsing; only the staging area is
registered, and a peer of the transfer engine reaches it but never the host
pool; batches larger than the staging area; the engine's listeners named at
start; a full store, a master killed and restarted mid-run, an unreachable
master at start, and clear() sparing other users' keys.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from tests.storage.conformance import BackendConformance, empty, keys, make, obj, same
from tests.storage.mooncake.services import INSTALL_HINT, MooncakeServices, free_port

try:
    import mooncake.store  # noqa: F401
except ImportError as err:  # pragma: no cover - the Makefile installs it
    pytest.skip(f"mooncake is not installed ({err}); {INSTALL_HINT}", allow_module_level=True)

from vllm_hicache.storage import StorageContext
from vllm_hicache.storage.mooncake import backend as backend_module
from vllm_hicache.storage.mooncake.backend import MooncakeBackend
from vllm_hicache.storage.mooncake.config import MooncakeConfig
from vllm_hicache.storage.mooncake.listeners import is_wildcard
from vllm_hicache.storage.mooncake.master import OutageGate

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    srv = MooncakeServices(tmp_path_factory.mktemp("mooncake")).start()
    yield srv
    srv.stop()


@pytest.fixture
def own_services(tmp_path):
    """Services this test may kill or fill."""
    started: list[MooncakeServices] = []

    def start(**kwargs) -> MooncakeServices:
        started.append(MooncakeServices(tmp_path / f"mc-{len(started)}", **kwargs).start())
        return started[-1]

    yield start
    for srv in started:
        srv.stop()


def build(address: str, object_bytes: int = 64 + 4096, **options) -> MooncakeBackend:
    return MooncakeBackend({"master_server_address": address, **options},
                           StorageContext("worker", 0, 1, object_bytes))


def big_obj(seed: int, payload: int) -> list[np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, 64 + payload, dtype=np.uint8)
    return [data[:64].copy(), data[64:].copy()]


class TestMooncakeConformance(BackendConformance):
    @pytest.fixture
    def spec(self, services):
        return "mooncake", {"master_server_address": services.address}

    @pytest.fixture
    def backend(self, spec):
        b = make(spec)
        yield b
        b.close()


# --- options ---


def test_options_are_validated():
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeConfig.from_options({})
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeConfig.from_options({"master_server_address": "127.0.0.1"})
    with pytest.raises(ValueError, match="protocol"):
        MooncakeConfig.from_options({"master_server_address": "h:1", "protocol": "udp"})
    with pytest.raises(ValueError, match="connect_timeout_s"):
        MooncakeConfig.from_options({"master_server_address": "h:1", "connect_timeout_s": 60})
    with pytest.raises(ValueError, match="local_buffer_size"):
        MooncakeConfig.from_options({"master_server_address": "h:1", "local_buffer_size": "lots"})
    with pytest.raises(ValueError, match="accepted: .*staging_pages"):
        MooncakeConfig.from_options({"master_server_address": "h:1", "bogus": 1})
    for bad in (0, "lots", 1.5, 5000):
        with pytest.raises(ValueError, match="staging_pages"):
            MooncakeConfig.from_options({"master_server_address": "h:1", "staging_pages": bad})
    cfg = MooncakeConfig.from_options({"master_server_address": "[::1]:50051",
                                       "global_segment_size": "4 GiB",
                                       "local_buffer_size": "64MB"})
    assert (cfg.global_segment_size, cfg.local_buffer_size) == (4 << 30, 64 << 20)
    assert cfg.metadata_server == "P2PHANDSHAKE" and cfg.protocol == "tcp"
    assert cfg.staging_pages == 128


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mooncake.store", None)
    with pytest.raises(ImportError, match="pip install mooncake-transfer-engine-non-cuda"):
        build("127.0.0.1:1")


def test_unreachable_master_fails_fast_naming_it():
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"mooncake backend: master {address}"):
        build(address)  # default connect_timeout_s
    assert time.monotonic() - start < 30


# --- data path ---


class SpyStore:
    """The real store, recording what the backend registers and each call."""

    def __init__(self, store) -> None:
        self._store = store
        self.registered: list[tuple[int, int]] = []
        self.calls: list[tuple[str, int]] = []

    def register_buffer(self, ptr: int, nbytes: int) -> int:
        self.registered.append((ptr, nbytes))
        return self._store.register_buffer(ptr, nbytes)

    def batch_put_from(self, keys, ptrs, sizes):
        self.calls.append(("put", len(keys)))
        return self._store.batch_put_from(keys, ptrs, sizes)

    def batch_get_into(self, keys, ptrs, sizes):
        self.calls.append(("get", len(keys)))
        return self._store.batch_get_into(keys, ptrs, sizes)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.fixture
def spied(monkeypatch):
    """Backends built in this test talk to Mooncake through a SpyStore."""
    spies: list[SpyStore] = []
    real_connect = backend_module.connect

    def connect(store_cls, cfg):
        spies.append(SpyStore(real_connect(store_cls, cfg)))
        return spies[-1]

    monkeypatch.setattr(backend_module, "connect", connect)
    return spies


def overlaps(ptr: int, nbytes: int, region: np.ndarray) -> bool:
    start = region.ctypes.data
    return ptr < start + region.nbytes and start < ptr + nbytes


def test_only_the_staging_area_is_registered(services, spied):
    """The host pool handed to register_memory is never registered: one
    region, staging_pages slots of one (padded) object, and pages in the pool
    round-trip through it."""
    payload, n = 64 * 1024, 8
    b = build(services.address, object_bytes=64 + payload, staging_pages=4)
    try:
        pool = np.zeros(2 * n * payload, np.uint8)
        b.register_memory(pool)
        spy = spied[0]
        assert spy.registered == [(b._staging.buffer.ctypes.data, 4 * (64 + payload))]
        assert not any(overlaps(ptr, size, pool) for ptr, size in spy.registered)
        assert b.stats()["registered_bytes"] == 4 * (64 + payload)
        objs = [big_obj(i, payload) for i in range(n)]
        pages = [pool[i * payload:(i + 1) * payload] for i in range(2 * n)]
        for i, (_, data) in enumerate(objs):
            pages[i][:] = data
        ks = keys(n)
        assert b.put(ks, [[h, pages[i]] for i, (h, _) in enumerate(objs)]) == [True] * n
        targets = [[np.zeros(64, np.uint8), pages[n + i]] for i in range(n)]
        assert b.get(ks, targets) == [True] * n
        assert all(same(t, o) for t, o in zip(targets, objs))
        assert b.stats()["staged_bytes"] == 2 * n * (64 + payload)
        assert len(spy.registered) == 1  # still: I/O registered nothing more
    finally:
        b.close()


def test_the_scheduler_half_registers_nothing(services, spied):
    b = MooncakeBackend({"master_server_address": services.address},
                        StorageContext("scheduler", 0, 1, 64 + 4096))
    try:
        assert b.exists_prefix(keys(2)) == 0
        assert spied[0].registered == []
    finally:
        b.close()


def test_a_peer_reaches_the_staging_area_but_never_the_pool(services):
    """The attack: any process that reaches the transfer engine's port asks
    it to read or write an address of ours, with no credentials. The pool's
    addresses are refused both ways; the staging area (what is in flight)
    stays reachable, which is why docs/security.md says to firewall it."""
    from mooncake.engine import TransferEngine

    payload = 4096
    b = build(services.address, object_bytes=64 + payload, staging_pages=2)
    try:
        pool = np.full(4 * payload, 0x5A, np.uint8)
        b.register_memory(pool)
        source = big_obj(7, payload)
        pool[:payload] = source[1]
        assert b.put(keys(1), [[source[0], pool[:payload]]]) == [True]

        peer = TransferEngine()
        assert peer.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        staging = b._staging.buffer
        loot = np.zeros(staging.nbytes, np.uint8)
        assert peer.register_memory(loot.ctypes.data, loot.nbytes) == 0
        # The engine's handshake port among what setup() opened: the one
        # through which a read of the (registered) staging area works.
        segments = [f"127.0.0.1:{port}" for _, port in sorted(b.engine_listeners)]
        reachable = [s for s in segments if peer.transfer_sync_read(
            s, loot.ctypes.data, staging.ctypes.data, staging.nbytes) == 0]
        assert reachable, f"no segment of {segments} answered"
        segment = reachable[0]
        # The last object that went through: exposed to the peer.
        assert bytes(source[0]) + bytes(source[1]) in loot.tobytes()

        loot[:] = 0
        assert peer.transfer_sync_read(segment, loot.ctypes.data, pool.ctypes.data,
                                       payload) != 0
        assert not loot.any()
        loot[:] = 0xEE
        assert peer.transfer_sync_write(segment, loot.ctypes.data, pool.ctypes.data + payload,
                                        payload) != 0
        assert (pool[payload:] == 0x5A).all()
    finally:
        b.close()


def test_engine_listeners_on_every_interface_are_named_at_start(services, caplog):
    """Mooncake binds its listeners to every interface whatever
    local_hostname says (and MC_TCP_BIND_ADDRESS changes nothing): the
    start-up log says so, naming the ports. If a Mooncake release binds one
    interface, this fails: then update listeners.py and docs/security.md."""
    with caplog.at_level(logging.WARNING, "vllm_hicache.storage.mooncake.listeners"):
        b = build(services.address, local_hostname="127.0.0.1")
    try:
        assert b.engine_listeners and all(is_wildcard(lst) for lst in b.engine_listeners)
        warning = " ".join(r.getMessage() for r in caplog.records)
        assert "listens on every interface" in warning
        assert "cannot be bound to local_hostname=127.0.0.1" in warning
        for _, port in b.engine_listeners:
            assert f":{port}" in warning
    finally:
        b.close()


def test_batches_larger_than_staging_are_chunked(services, spied):
    """20 objects through 3 slots: 7 Mooncake calls each way, every byte
    right; an object longer than a slot is a per-key False, never sent."""
    payload = 64 * 1024
    b = build(services.address, object_bytes=64 + payload, staging_pages=3)
    try:
        ks, objs = keys(20), [big_obj(i, payload) for i in range(20)]
        assert b.put(ks, objs) == [True] * 20
        targets = [[np.zeros(64, np.uint8), np.zeros(payload, np.uint8)] for _ in ks]
        assert b.get(ks, targets) == [True] * 20
        assert all(same(t, o) for t, o in zip(targets, objs))
        assert spied[0].calls == [("put", 3)] * 6 + [("put", 2)] + [("get", 3)] * 6 + [("get", 2)]
        huge = [np.zeros(64, np.uint8), np.zeros(4 * MIB, np.uint8)]
        assert b.put(keys(3), [objs[0], huge, objs[1]]) == [True, False, True]
        assert b.stats()["staging_slots"] == 3
    finally:
        b.close()


def test_concurrent_calls_share_the_staging_area(services):
    """More threads than slots: each call waits for a free slot, and no two
    calls ever share one (every object comes back as written)."""
    payload = 16 * 1024
    b = build(services.address, object_bytes=64 + payload, staging_pages=2)
    failures: list[str] = []

    def worker(seed: int) -> None:
        ks, objs = keys(5), [big_obj(seed * 10 + i, payload) for i in range(5)]
        if b.put(ks, objs) != [True] * 5:
            failures.append(f"put {seed}")
            return
        targets = [[np.zeros(64, np.uint8), np.zeros(payload, np.uint8)] for _ in ks]
        if b.get(ks, targets) != [True] * 5 or not all(map(same, targets, objs)):
            failures.append(f"get {seed}")

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures and not any(t.is_alive() for t in threads)
    finally:
        b.close()


def test_clear_spares_keys_of_other_users(services):
    import mooncake.store as ms

    raw = ms.MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", services.address) == 0
    b = build(services.address)
    try:
        assert raw.put("other-app-key", b"x" * 100) == 0
        ks = keys(3)
        b.put(ks, [obj(i) for i in range(3)])
        b.clear()
        assert b.exists_prefix(ks) == 0
        assert raw.get("other-app-key") == b"x" * 100
    finally:
        raw.remove("other-app-key")
        raw.close()
        b.close()


# --- faults ---


def test_full_store_skips_writes_and_keeps_what_it_stored(own_services):
    srv = own_services(segment="16MB")
    payload = MIB
    b = build(srv.address, object_bytes=64 + payload)
    try:
        ks, objs = keys(40), [big_obj(i, payload) for i in range(40)]
        stored = b.put(ks, objs)
        assert True in stored and False in stored  # 40 MiB into 16 MiB
        assert b.stats()["put_full"] >= 1
        targets = [[np.zeros(64, np.uint8), np.zeros(payload, np.uint8)] for _ in ks]
        got = b.get(ks, targets)
        assert any(got)
        for i, hit in enumerate(got):
            # Anything read is exactly what was written (eviction may take more).
            assert not hit or (stored[i] and same(targets[i], objs[i]))
    finally:
        b.close()


def test_master_outage_is_bounded_and_recovers(own_services):
    """Scenario: 1. store works; 2. master SIGKILLed: the first call fails
    within ~5 s, later calls fail fast; 3. master restarted on the same port:
    service resumes without a new setup (the restarted index is empty)."""
    srv = own_services()
    b = build(srv.address, outage_backoff_s=3.0)
    try:
        ks = keys(4)
        assert b.put(ks[:2], [obj(0), obj(1)]) == [True, True]
        srv.kill_master()
        start = time.monotonic()
        assert b.get(ks[:2], [empty(), empty()]) == [False, False]
        assert time.monotonic() - start < 8
        start = time.monotonic()
        assert b.exists_prefix(ks) == 0 and b.put(ks[2:3], [obj(2)]) == [False]
        assert time.monotonic() - start < 1  # the gate is open: no 4 s waits
        assert b.stats()["outage_skips"] >= 2
        srv.start_master()
        assert srv.wait_writable()
        deadline = time.monotonic() + 30
        while b.put(ks[3:], [obj(3)]) != [True] and time.monotonic() < deadline:
            time.sleep(0.5)
        target = empty()
        assert b.get(ks[3:], [target]) == [True] and same(target, obj(3))
        assert b.exists_prefix(ks[3:]) == 1
    finally:
        b.close()


def test_outage_gate_fails_fast_then_probes(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("vllm_hicache.storage.mooncake.master.time.monotonic",
                        lambda: clock[0])
    gate = OutageGate(backoff_s=2.0)
    assert gate.admit()
    gate.record(True)
    assert gate.is_open and not gate.admit()
    clock[0] += 2.5
    assert gate.admit()  # the probe
    assert not gate.admit()  # one probe at a time
    gate.record(True)
    assert not gate.admit()
    clock[0] += 2.5
    assert gate.admit()
    gate.record(False)
    assert not gate.is_open and gate.admit() and gate.admit()


def test_close_is_idempotent_and_later_calls_miss(services):
    b = build(services.address)
    ks = keys(1)
    assert b.put(ks, [obj(0)]) == [True]
    b.close()
    b.close()
    assert b.get(ks, [empty()]) == [False]
    assert b.put(ks, [obj(0)]) == [False]
    assert b.exists_prefix(ks) == 0
