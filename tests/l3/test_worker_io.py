"""StorageIO: reads never queue behind writes; at shutdown queued backups
reach L3 within a bounded drain, queued prefetches are dropped, and a stuck
backend cannot hang shutdown."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import pytest
import torch

from tests.connector.mem_backend import STORES, MemBackend
from vllm_hicache.common.jobs import BackupJob, PrefetchJob, PrefetchProgress
from vllm_hicache.common.stats import key
from vllm_hicache.host import HostKVPool
from vllm_hicache.io_threads import Background
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3 import worker_io as l3_worker
from vllm_hicache.l3.worker_io import StorageIO
from vllm_hicache.storage import StorageContext
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.pages import PageStore

NUM_PAGES = 16
# "Forever" for a blocked backend call, yet finite: a regression that waits
# on it fails the test instead of hanging the run.
GATE_TIMEOUT_S = 30.0
LOGGER = "vllm_hicache.l3.worker_io"


class SlowBackend(MemBackend):
    """MemBackend whose puts take ``put_delay_s`` and wait for ``put_gate``;
    gets wait for ``get_gate`` and are counted."""

    def __init__(self, options, ctx) -> None:
        super().__init__(options, ctx)
        self.put_delay_s = 0.0
        self.put_gate: threading.Event | None = None
        self.get_gate: threading.Event | None = None
        self.num_gets = 0

    def put(self, keys, sources):
        if self.put_gate is not None:
            self.put_gate.wait(GATE_TIMEOUT_S)
        time.sleep(self.put_delay_s)
        return super().put(keys, sources)

    def get(self, keys, targets):
        self.num_gets += 1
        if self.get_gate is not None:
            self.get_gate.wait(GATE_TIMEOUT_S)
        return super().get(keys, targets)


@pytest.fixture
def store():
    pool = HostKVPool(NUM_PAGES, 2, 2, 4, 2, 8, torch.float32, "page_first", pin_memory=False)
    pool.buffer.copy_(torch.randn_like(pool.buffer))
    name = f"l3-worker-{uuid.uuid4().hex}"
    ctx = StorageContext("worker", 0, 1, HEADER_BYTES + pool.bytes_per_page)
    backend = SlowBackend({"store": name}, ctx)
    ns = KeyNamespace("test/model", "float32", "page_first", 4, 1, 0)
    yield PageStore(backend, pool, ns)
    # Whatever a test blocked must be able to finish, or interpreter exit
    # would wait on the pool thread stuck in it.
    for gate in (backend.put_gate, backend.get_gate):
        if gate is not None:
            gate.set()
    STORES.pop(name, None)


def _wait_for(condition, timeout_s: float = GATE_TIMEOUT_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "condition not reached"
        time.sleep(0.005)


def backup(op_id: int, page: int) -> BackupJob:
    return BackupJob(op_id, (bytes([page]) * 8,), (page,))


def landed(pages: PageStore, page: int) -> bool:
    """Was ``page`` written to L3 intact? Read it into a spare page and compare."""
    spare = NUM_PAGES - 1
    pages.pool.buffer[spare].zero_()
    if pages.read([bytes([page]) * 8], [spare]) != 1:
        return False
    return torch.equal(pages.pool.read_pages([page]), pages.pool.read_pages([spare]))


def test_queued_backups_drain_at_shutdown(store, caplog):
    store.backend.put_delay_s = 0.2
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    for page in range(4):
        io.submit_backup(backup(page, page))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        io.shutdown()

    assert [page for page in range(4) if not landed(store, page)] == []
    assert "drained 4 backups" in caplog.text
    assert "abandoned" not in caplog.text
    # Every drained backup is still acknowledged.
    assert io.poll()[1] == {0, 1, 2, 3}


def test_stuck_backend_cannot_hang_shutdown(store, caplog):
    store.backend.put_gate = threading.Event()  # never set during the test
    drain_timeout_s = 0.5
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1,
                   drain_timeout_s=drain_timeout_s)
    for page in range(3):
        io.submit_backup(backup(page, page))
    start_s = time.monotonic()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        io.shutdown()
    elapsed_s = time.monotonic() - start_s

    # Bounded: the put never returns, yet shutdown does (slack for a busy CI host).
    assert drain_timeout_s <= elapsed_s < drain_timeout_s + 3.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("abandoned 3 of 3" in m for m in warnings), warnings


def test_queued_prefetches_are_cancelled_at_shutdown(store, caplog):
    """The read thread is held in a get: the two prefetches queued behind it
    never reach the store, while the held backup still drains."""
    put_gate, get_gate = threading.Event(), threading.Event()
    store.backend.put_gate, store.backend.get_gate = put_gate, get_gate
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    io.submit_backup(backup(0, 0))  # occupies the only write thread until its gate opens
    io.submit_prefetch(PrefetchJob(10, (bytes([0]) * 8,), (8,)))  # the only read thread
    _wait_for(lambda: store.backend.num_gets == 1)
    io.submit_prefetch(PrefetchJob(11, (bytes([1]) * 8,), (9,)))
    io.submit_prefetch(PrefetchJob(12, (bytes([2]) * 8,), (10,)))
    io.submit_backup(backup(1, 1))
    threading.Timer(0.3, put_gate.set).start()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        io.shutdown()
    get_gate.set()

    assert io.wait_idle(10)
    assert store.backend.num_gets == 1
    assert landed(store, 0) and landed(store, 1)
    assert "cancelled 2 queued prefetches" in caplog.text


def test_a_read_never_waits_behind_writes(store):
    """A slow store's puts hold every write thread: a prefetch submitted after
    them still runs at once, on a thread of its own."""
    for page in range(2):
        store.write([bytes([page]) * 8], [page])
    store.backend.put_gate = gate = threading.Event()
    io = StorageIO(store, worker_id=0, writes=True, num_threads=2)
    try:
        for page in range(2, 6):  # two running, two queued: all held by the gate
            io.submit_backup(backup(page, page))
        io.submit_prefetch(PrefetchJob(20, (bytes([0]) * 8, bytes([1]) * 8), (8, 9)))
        assert io.wait_read(20, 2, GATE_TIMEOUT_S) == 2
        assert not gate.is_set()
        progress, backups_done = io.poll()
        assert progress == {20: PrefetchProgress(2, True)} and backups_done == set()
        assert io.take_prefetch_timings()[20].queue_s < GATE_TIMEOUT_S / 2
    finally:
        gate.set()
        io.shutdown()
    assert io.poll()[1] == {2, 3, 4, 5}


def test_backups_run_in_the_background_and_reads_at_the_engine_s_priority(store, monkeypatch):
    """Nobody waits for a backup: it runs on l3/worker_io.BACKUPS threads,
    below the process (on a CPU server they share a core with the engine
    core); a prefetch keeps the process's priority."""
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    # Patient enough that the rescuer (at the process's priority) never runs it.
    monkeypatch.setattr(l3_worker, "BACKUPS", Background(nice=10, patience_s=60.0))
    seen: dict[str, int] = {}
    backend, put, get = store.backend, store.backend.put, store.backend.get
    backend.put = lambda keys, sources: (seen.setdefault("put", nice()), put(keys, sources))[1]
    backend.get = lambda keys, targets: (seen.setdefault("get", nice()), get(keys, targets))[1]
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    try:
        io.submit_backup(backup(3, 3))
        _wait_for(lambda: 3 in io.poll()[1])
        io.submit_prefetch(PrefetchJob(30, (bytes([3]) * 8,), (9,)))
        assert io.wait_read(30, 1, GATE_TIMEOUT_S) == 1
    finally:
        io.shutdown()
    base = nice()
    assert seen == {"put": min(19, base + 10), "get": base}


def hold_first_put(store, priorities: list[int]) -> tuple[threading.Event, threading.Event]:
    """The store's first put blocks (bounded) until the returned ``gate`` is
    set; ``held`` is set once it blocks. Each put's thread nice value goes to
    ``priorities``."""
    gate, held = threading.Event(), threading.Event()
    put = store.backend.put

    def first_put_blocks(keys, sources):
        priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if not held.is_set():
            held.set()
            gate.wait(GATE_TIMEOUT_S)
        return put(keys, sources)

    store.backend.put = first_put_blocks
    return gate, held


def test_a_backup_no_background_thread_starts_is_rescued_and_counted(store, monkeypatch):
    """The background threads held (a busy core, in effect): the next
    backup still starts, at the process's priority, once its patience is
    over, and the rescue is counted (l3_backups_rescued)."""
    monkeypatch.setattr(l3_worker, "BACKUPS", Background(nice=10, patience_s=0.2))
    gate, held = hold_first_put(store, [])
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    try:
        io.submit_backup(backup(1, 2))  # holds the one background thread
        assert held.wait(GATE_TIMEOUT_S)
        io.submit_backup(backup(2, 3))
        _wait_for(lambda: 2 in io.poll()[1])
        assert io.counters.take().get(key("l3_backups_rescued")) == 1
    finally:
        gate.set()
        io.shutdown()


def test_a_stop_hurries_the_backups_to_the_engine_s_priority(store, monkeypatch):
    """A graceful stop's flush (hurry_backups): a backup the one background
    thread would have run after the one it holds, and the rescuer only
    after its (here endless) patience, starts at once at the process's
    priority, and it is no rescue (not counted)."""
    monkeypatch.setattr(l3_worker, "BACKUPS", Background(nice=10, patience_s=60.0))
    priorities: list[int] = []
    gate, held = hold_first_put(store, priorities)
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    try:
        io.submit_backup(backup(1, 2))  # holds the one background thread
        assert held.wait(GATE_TIMEOUT_S)
        io.submit_backup(backup(2, 3))
        io.hurry_backups()
        io.hurry_backups()  # every step of the flush says so: once is enough
        _wait_for(lambda: 2 in io.poll()[1])
        assert not gate.is_set()
        assert key("l3_backups_rescued") not in io.counters.take()
    finally:
        gate.set()
        io.shutdown()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert priorities == [min(19, base + 10), base]


def test_running_prefetch_stops_at_next_batch(store, monkeypatch):
    monkeypatch.setattr(l3_worker, "BATCH_PAGES", 2)
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    hashes = tuple(bytes([p]) * 8 for p in range(4))
    for page in range(4):
        io.submit_backup(backup(page, page))
    assert io.wait_idle(10)
    gate = threading.Event()
    store.backend.get_gate = gate
    io.submit_prefetch(PrefetchJob(5, hashes, (8, 9, 10, 11)))
    deadline_s = time.monotonic() + 10
    while store.backend.num_gets == 0 and time.monotonic() < deadline_s:
        time.sleep(0.005)  # until the first batch is inside the backend
    start_s = time.monotonic()
    io.shutdown()
    assert time.monotonic() - start_s < 5.0  # shutdown does not wait for prefetches
    gate.set()

    assert io.wait_idle(10)
    assert store.backend.num_gets == 1
    assert io.poll()[0] == {5: PrefetchProgress(2, True)}


def test_backup_then_prefetch_carries_page_states(store, monkeypatch):
    """A model with a state group: each backed-up page's state flag comes back
    with the prefetch, per page, across batches."""
    monkeypatch.setattr(l3_worker, "BATCH_PAGES", 2)
    store.page_states = True
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    try:
        hashes = tuple(bytes([p]) * 8 for p in range(5))
        io.submit_backup(BackupJob(1, hashes, (0, 1, 2, 3, 4),
                                   (False, True, False, False, True)))
        assert io.wait_idle(10)
        io.submit_prefetch(PrefetchJob(2, hashes, (8, 9, 10, 11, 12)))
        assert io.wait_idle(10)
        assert io.poll()[0] == {2: PrefetchProgress(5, True, frozenset({1, 4}))}
    finally:
        io.shutdown()


def test_a_finished_prefetch_reports_where_its_time_went(store):
    """Queued behind a held read, then read: its timing comes with (or
    before) the poll that reports it finished, once, in durations that add up
    to no more than the time it took."""
    hashes = tuple(bytes([p]) * 8 for p in range(3))
    for page in range(3):
        store.write([hashes[page]], [page])
    store.backend.get_gate = gate = threading.Event()
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    io.submit_prefetch(PrefetchJob(5, hashes[:1], (11,)))  # holds the only read thread
    _wait_for(lambda: store.backend.num_gets == 1)
    started_s = time.perf_counter()
    io.submit_prefetch(PrefetchJob(6, hashes, (8, 9, 10)))
    time.sleep(0.05)
    assert io.take_prefetch_timings() == {}  # still queued behind the held read
    gate.set()
    assert io.wait_idle(10)
    elapsed_s = time.perf_counter() - started_s
    progress, _ = io.poll()
    assert progress == {5: PrefetchProgress(1, True), 6: PrefetchProgress(3, True)}
    timing = io.take_prefetch_timings()[6]
    assert timing.queue_s >= 0.04  # it waited for the thread the first read held
    assert timing.io_s > 0 and timing.check_s > 0
    assert sum(timing) <= elapsed_s
    assert io.take_prefetch_timings() == {}
    io.shutdown()


def test_wait_read_returns_once_the_pages_are_read(store):
    """Same-step loads (l3/same_step.py) wait for a read, not a step."""
    for page in range(2):
        store.write([bytes([page]) * 8], [page])
    store.backend.get_gate = gate = threading.Event()
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    io.submit_prefetch(PrefetchJob(7, (bytes([0]) * 8, bytes([1]) * 8), (8, 9)))
    started = time.monotonic()
    assert io.wait_read(7, 2, 0.05) == 0  # held back: bounded, nothing read
    assert time.monotonic() - started >= 0.05
    threading.Timer(0.05, gate.set).start()
    assert io.wait_read(7, 2, GATE_TIMEOUT_S) == 2
    assert time.monotonic() - started < GATE_TIMEOUT_S / 2  # woken by the read, not the timeout
    assert io.wait_read(99, 1, 1.0) == 0  # an op it never ran: no wait, nothing read
    io.shutdown()


def test_wait_read_stops_at_a_missing_object(store):
    store.write([bytes([0]) * 8], [0])  # block 1 is not in L3
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    io.submit_prefetch(PrefetchJob(8, (bytes([0]) * 8, bytes([1]) * 8), (8, 9)))
    started = time.monotonic()
    assert io.wait_read(8, 2, GATE_TIMEOUT_S) == 1  # the read ended short: no timeout
    assert time.monotonic() - started < GATE_TIMEOUT_S / 2
    io.shutdown()


class LayeredPages:
    """A PageTier that reads by layer: layer i of every page lands when
    ``gates[i]`` opens; the read then says ``verified`` pages passed."""

    def __init__(self, wrapped: PageStore, num_layers: int, verified: int) -> None:
        self.wrapped, self.verified = wrapped, verified
        self.gates = [threading.Event() for _ in range(num_layers)]
        self.pool, self.backend = wrapped.pool, wrapped.backend
        self.reads_by_layer = True

    def read_by_layer(self, hashes, pages, on_layer) -> int:
        for layer, gate in enumerate(self.gates):
            assert gate.wait(GATE_TIMEOUT_S)
            on_layer(layer, len(pages))
        return self.verified

    def take_check_seconds(self) -> float:
        return 0.0

    def stats(self) -> dict[str, float]:
        return {}


def test_wait_layer_returns_as_each_layer_lands(store):
    """A same-step L1 copy of layer i waits for layer i of the read only;
    what the read then verifies is its final count."""
    pages = LayeredPages(store, num_layers=2, verified=1)
    io = StorageIO(pages, worker_id=0, writes=True, num_threads=1)
    io.submit_prefetch(PrefetchJob(5, (b"a" * 8, b"b" * 8), (8, 9)), by_layer=True)
    started = time.monotonic()
    assert io.wait_layer(5, 0, 2, 0.05) == 0  # held back: bounded, nothing there
    assert time.monotonic() - started >= 0.05
    threading.Timer(0.05, pages.gates[0].set).start()
    assert io.wait_layer(5, 0, 2, GATE_TIMEOUT_S) == 2
    assert time.monotonic() - started < GATE_TIMEOUT_S / 2  # woken by the layer
    assert io.wait_layer(5, 1, 2, 0.05) == 0  # layer 1 has not landed
    assert io.wait_read(5, 2, 0.0) == 0  # nothing verified yet
    pages.gates[1].set()
    assert io.wait_layer(5, 1, 2, GATE_TIMEOUT_S) == 2
    assert io.wait_read(5, 2, GATE_TIMEOUT_S) == 1  # one page passed its check
    progress, _ = io.poll()
    assert progress[5] == PrefetchProgress(1, True)
    assert io.wait_layer(5, 0, 2, 0.0) == 0  # reported finished: forgotten
    io.shutdown()


def test_by_layer_on_a_store_that_cannot_reads_whole(store):
    """The store reads whole objects only: the request is served by a whole
    read, and every layer is there once it is."""
    assert not store.reads_by_layer  # page_first
    store.write([bytes([0]) * 8], [0])
    io = StorageIO(store, worker_id=0, writes=True, num_threads=1)
    io.submit_prefetch(PrefetchJob(6, (bytes([0]) * 8,), (8,)), by_layer=True)
    assert io.wait_layer(6, 1, 1, GATE_TIMEOUT_S) == 1
    assert io.wait_read(6, 1, 0.0) == 1
    io.shutdown()
