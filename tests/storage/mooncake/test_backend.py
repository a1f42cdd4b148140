"""The mooncake L3 backend against a real mooncake_master + storage daemon.

Services come from services.py, on loopback; run the session in a
private network namespace (Mooncake's transfer engine also listens on all
interfaces). Beyond conformance: option parsing, zero copy from registered
memory, a full store, a master killed and restarted mid-run, an unreachable
master at start, and clear() sparing other users' keys.
"""

from __future__ import annotations

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
from vllm_hicache.storage.mooncake.backend import MooncakeBackend
from vllm_hicache.storage.mooncake.config import MooncakeConfig
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
    with pytest.raises(ValueError, match="accepted: .*staging_bytes"):
        MooncakeConfig.from_options({"master_server_address": "h:1", "bogus": 1})
    cfg = MooncakeConfig.from_options({"master_server_address": "[::1]:50051",
                                       "global_segment_size": "4 GiB",
                                       "local_buffer_size": "64MB"})
    assert (cfg.global_segment_size, cfg.local_buffer_size) == (4 << 30, 64 << 20)
    assert cfg.metadata_server == "P2PHANDSHAKE" and cfg.protocol == "tcp"


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


def test_zero_copy_from_registered_memory(services):
    """Payloads inside the registered pool go to Mooncake by address; only the
    64-byte headers are staged."""
    payload, n = 64 * 1024, 8
    b = build(services.address, object_bytes=64 + payload)
    try:
        pool = np.zeros(n * 2 * payload, np.uint8)
        b.register_memory(pool)
        assert b.stats()["registered_regions"] == 1
        objs = [big_obj(i, payload) for i in range(n)]
        pages = [pool[i * payload:(i + 1) * payload] for i in range(2 * n)]
        for i, (_, data) in enumerate(objs):
            pages[i][:] = data
        ks = keys(n)
        assert b.put(ks, [[h, pages[i]] for i, (h, _) in enumerate(objs)]) == [True] * n
        headers = [np.zeros(64, np.uint8) for _ in ks]
        targets = [[headers[i], pages[n + i]] for i in range(n)]
        assert b.get(ks, targets) == [True] * n
        assert all(same(t, o) for t, o in zip(targets, objs))
        stats = b.stats()
        assert stats["direct_bytes"] == 2 * n * payload
        assert stats["staged_bytes"] == 2 * n * 64
    finally:
        b.close()


def test_batches_larger_than_staging_are_chunked(services):
    """Unregistered 64 KiB payloads through a 256 KiB staging buffer: many
    chunks, and an object that can never fit is a per-key False."""
    payload = 64 * 1024
    b = build(services.address, object_bytes=64 + payload, staging_bytes=256 * 1024)
    try:
        ks, objs = keys(20), [big_obj(i, payload) for i in range(20)]
        assert b.put(ks, objs) == [True] * 20
        targets = [[np.zeros(64, np.uint8), np.zeros(payload, np.uint8)] for _ in ks]
        assert b.get(ks, targets) == [True] * 20
        assert all(same(t, o) for t, o in zip(targets, objs))
        huge = [np.zeros(64, np.uint8), np.zeros(4 * MIB, np.uint8)]
        assert b.put(keys(2), [objs[0], huge]) == [True, False]
        assert b.stats()["staging_buffers"] == 1
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
