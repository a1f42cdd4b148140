"""The L3 tier through vLLM's real Scheduler and our worker half, with an
in-process store (tests/connector/mem_backend.py)."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from tests.connector import mem_backend
from tests.connector.harness import BLOCK, make_harness
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.l3.canary import is_canary_key
from vllm_hicache.l3.health_check import probe_key


def l3_harness(model_dir, policy="wait_complete", threshold=BLOCK, max_num_seqs=8,
               backend_class="MemBackend", **extra):
    store = uuid.uuid4().hex
    h = make_harness(
        model_dir, max_num_seqs=max_num_seqs,
        hicache_storage_backend="dynamic",
        hicache_storage_prefetch_policy=policy,
        hicache_storage_backend_extra_config={
            "module_path": "tests.connector.mem_backend", "class_name": backend_class,
            "store": store, "prefetch_threshold": threshold, **extra,
        },
    )
    return h, mem_backend.STORES[store]


def num_pages_stored(store) -> int:
    """Objects holding pages (each worker also writes one start-up canary)."""
    return sum(not is_canary_key(k) for k in store)


def forget_l1_and_l2(h) -> None:
    assert h.scheduler.reset_prefix_cache()
    assert h.scheduler.connector.reset_cache()
    h.kv_zero()


def test_backup_then_prefetch_round_trip(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    tokens = prompt(20, 5 * BLOCK + 3)
    h.add("a", tokens)
    h.run()
    h.step()  # let the last acks in
    assert num_pages_stored(store) == 5
    assert h.sched_half.tree.num_locked_pages == 0  # backups acknowledged
    forget_l1_and_l2(h)
    h.add("b", tokens)
    h.run()
    assert h.first_computed["b"] == 5 * BLOCK
    assert h.sched_half.l3.prefetched_blocks == 5
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def hold_backups(h) -> threading.Event:
    """Backups wait (bounded) until the returned gate is set."""
    gate = threading.Event()
    real_backup = h.worker.worker._io._backup

    def held_backup(job, ready):
        assert gate.wait(timeout=10)
        real_backup(job, ready)

    h.worker.worker._io._backup = held_backup
    return gate


def test_backup_pins_pages_until_acknowledged(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    gate = hold_backups(h)
    h.add("a", prompt(21, 3 * BLOCK + 1), max_tokens=1)
    for _ in range(50):  # until the lookup (a miss) lets "a" run
        h.step(complete_async=False)
        if "a" in h.first_computed:
            break
        time.sleep(0.005)
    assert h.sched_half.tree.num_locked_pages == 3
    gate.set()
    assert h.worker.worker._io.wait_idle(10)
    h.step()
    h.step()
    assert h.sched_half.tree.num_locked_pages == 0
    assert num_pages_stored(store) == 3


def test_corrupt_object_is_a_miss(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    tokens = prompt(22, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    h.step()
    keys = sorted(store)
    victim = h.sched_half.l3.namespaces[0].object_keys([h.hashes_of["a"].block_hashes[2]])[0]
    blob = bytearray(store[victim])
    blob[200] ^= 0xFF
    store[victim] = bytes(blob)
    assert victim in keys
    forget_l1_and_l2(h)
    h.add("b", tokens)
    h.run()
    assert h.first_computed["b"] == 2 * BLOCK  # blocks 0, 1 only: 2 is bad
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_best_effort_prefetches_while_the_request_queues(tiny_model_dir):
    """Scenario: one sequence slot, busy. B arrives and queues; its L3
    prefetch runs meanwhile, so when B is scheduled its prefix is in L2."""
    h, _ = l3_harness(tiny_model_dir, policy="best_effort", max_num_seqs=1)
    tokens = prompt(23, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    h.step()
    forget_l1_and_l2(h)
    h.add("blocker", prompt(99, BLOCK + 1), max_tokens=40)
    h.step()
    h.add("b", tokens)
    h.run()
    assert h.sched_half.l3.prefetched_blocks == 4
    assert h.first_computed["b"] == 4 * BLOCK
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_timeout_policy_gives_up_at_the_deadline(tiny_model_dir):
    h, _ = l3_harness(tiny_model_dir, policy="timeout", prefetch_timeout_base=0.2,
                      prefetch_timeout_per_ki_token=0.0)
    tokens = prompt(24, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    h.step()
    forget_l1_and_l2(h)
    mem_backend.GATES[h.sched_half.l3.backend.store_name] = gate = threading.Event()
    try:
        start = time.monotonic()
        h.add("b", tokens)
        while "b" not in h.first_computed and time.monotonic() - start < 5:
            h.step(complete_async=False)
            time.sleep(0.01)
        waited = time.monotonic() - start
        assert h.first_computed["b"] == 0
        assert 0.2 <= waited < 2.0
    finally:
        gate.set()
    h.run()


def test_short_hits_are_not_prefetched(tiny_model_dir):
    h, _ = l3_harness(tiny_model_dir, threshold=8 * BLOCK)
    tokens = prompt(25, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    h.step()
    forget_l1_and_l2(h)
    h.add("b", tokens)
    h.run()
    assert h.first_computed["b"] == 0
    assert h.sched_half.l3.prefetched_blocks == 0


def test_admin_clear_empties_l3_and_reset_keeps_it(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    h.add("a", prompt(26, 3 * BLOCK + 1))
    h.run()
    h.step()
    assert h.scheduler.connector.reset_cache()
    assert num_pages_stored(store) == 3  # reset_cache leaves L3 alone
    h.sched_half.l3.clear_storage()
    # The breaker's health check may write its object again at once.
    assert set(store) <= {probe_key(h.sched_half.l3.namespaces[0])}


def test_lookup_backlog_is_bounded(tiny_model_dir, monkeypatch):
    """Scenario: the store hangs; requests keep arriving. Lookups beyond the
    cap are skipped (no L3 hit) instead of queueing without bound."""
    from vllm_hicache.l3 import lookups as l3_lookups

    monkeypatch.setattr(l3_lookups, "MAX_PENDING_LOOKUPS", 3)
    h, _ = l3_harness(tiny_model_dir, policy="best_effort")
    planner = h.sched_half.l3
    gate = threading.Event()
    monkeypatch.setattr(planner.lookups, "_exists", lambda hashes: gate.wait(10) and 0)
    try:
        for i in range(6):
            h.add(f"r{i}", prompt(30 + i, 3 * BLOCK + 1), max_tokens=1)
        assert planner.skipped_lookups == 3
    finally:
        gate.set()
    h.run()
    assert_clean(h)


class StepClock:
    """The scheduler half's clock: time passes only in its sleeps and where
    a test advances it (the harness and the I/O threads keep theirs)."""

    def __init__(self) -> None:
        self.now = time.monotonic() + 1.0  # past any empty step before it
        self.naps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


def test_empty_steps_pause_while_a_request_waits_on_l3(tiny_model_dir, monkeypatch):
    from vllm_hicache.scheduler import scheduler as scheduler_module

    pause_s = scheduler_module.EMPTY_STEP_PAUSE_S
    h, _ = l3_harness(tiny_model_dir)
    tokens = prompt(27, 4 * BLOCK + 1)
    h.add("a", tokens)
    h.run()
    h.step()
    forget_l1_and_l2(h)
    clock = StepClock()
    naps = clock.naps
    monkeypatch.setattr(scheduler_module, "time", clock)
    mem_backend.GATES[h.sched_half.l3.backend.store_name] = gate = threading.Event()
    try:
        h.add("b", tokens)
        for _ in range(3):  # the prefetch is stuck: nothing can be scheduled
            so = h.step(complete_async=False)
            assert so.total_num_scheduled_tokens == 0
        # Back to back (this harness loop has no pause of its own): each
        # empty step after the first waits out the pause (the first may not
        # have waited on I/O yet, if its lookup had not started).
        assert naps in ([pytest.approx(pause_s)] * 2, [pytest.approx(pause_s)])
        naps.clear()
        for _ in range(3):
            clock.now += pause_s  # as vLLM 0.32's loop sleeps after an empty step
            so = h.step(complete_async=False)
            assert so.total_num_scheduled_tokens == 0
        assert naps == []  # that pause covered the spacing: no second one
    finally:
        gate.set()
    h.run()
    assert h.first_computed["b"] == 4 * BLOCK
    h.add("c", prompt(28, 2 * BLOCK + 1))
    busy_steps, deadline = 0, time.monotonic() + 10
    for _ in range(500):
        if not h.scheduler.has_unfinished_requests() or time.monotonic() > deadline:
            break
        before = len(naps)
        so = h.step()
        if so.total_num_scheduled_tokens:
            busy_steps += 1
            assert len(naps) == before, "a step that computes something paused"
        else:
            time.sleep(0.002)  # c's own lookup is still running
    assert busy_steps > 0 and not h.scheduler.has_unfinished_requests()


def test_a_shutdown_ends_every_thread_it_started_and_a_second_is_a_no_op(tiny_model_dir,
                                                                         caplog):
    """vLLM may shut a connector down twice (an engine's teardown, then its
    owner's close); both halves' L3 threads (health checks, lookups, reads,
    writes) end with the first, within a bound, and the second does nothing
    (no second drain, no second last line)."""
    before = set(threading.enumerate())
    h, store = l3_harness(tiny_model_dir)
    h.add("r", prompt(0, 3 * BLOCK))
    h.run()
    started = {t for t in threading.enumerate() if t.name.startswith("hicache")} - before
    assert {t.name.rstrip("0123456789_-") for t in started} >= {
        "hicache-l3-health", "hicache-lookup", "hicache-l3w"}
    with caplog.at_level(logging.INFO, logger="vllm_hicache"):
        h.close()
        h.close()
    drains = [r for r in caplog.records if "HiCache L3: shutdown drained" in r.getMessage()]
    assert len(drains) == 1, [r.getMessage() for r in caplog.records]
    deadline = time.monotonic() + 5.0
    while any(t.is_alive() for t in started) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [t.name for t in started if t.is_alive()]
