"""The L3 planner under its circuit breaker, through vLLM's real Scheduler
and our worker half (tests/l3/test_planner.py's harness): while the breaker
is not closed nothing touches the store and nobody waits for it, every skip
is counted, and once it closes L3 is used again."""

from __future__ import annotations

import threading
import time
import uuid

from tests.connector.harness import BLOCK
from tests.l3.test_planner import forget_l1_and_l2, l3_harness, num_pages_stored
from tests.scheduler.test_scheduler import assert_clean, prompt
from vllm_hicache.common.stats import SchedulerReport, key, planner_samples
from vllm_hicache.l3.breaker import BreakerState


class FakeHealth:
    """Stands in for L3Health: the test says when it trips and resumes."""

    def __init__(self) -> None:
        self.usable, self.trips, self.state = True, 0, BreakerState.CLOSED

    def trip(self) -> None:
        self.usable, self.state = False, BreakerState.TRIPPED
        self.trips += 1

    def resume(self) -> None:
        self.usable, self.state = True, BreakerState.CLOSED

    def status(self) -> dict[str, object]:
        return {"state": str(self.state), "trips": self.trips}

    def close(self) -> None:
        pass


def with_fake_health(h) -> FakeHealth:
    planner = h.sched_half.l3
    assert planner.health is not None, "the breaker is on by default"
    planner.health.close()
    planner.health = fake = FakeHealth()
    return fake


def test_tripped_breaker_skips_lookups_and_backups_then_l3_resumes(tiny_model_dir):
    h, store = l3_harness(tiny_model_dir)
    health = with_fake_health(h)
    planner = h.sched_half.l3
    tokens = prompt(40, 5 * BLOCK + 3)
    health.trip()
    h.step()  # the scheduler reads the breaker once per step
    h.add("a", tokens)
    h.run()
    h.step()
    assert num_pages_stored(store) == 0
    samples = planner_samples(planner)
    assert samples[key("prefetches", "breaker")] == 1
    assert samples[key("store_skipped_blocks", "L3", "breaker")] == 5
    assert samples[key("l3_breaker_trips")] == 1
    h.sched_half._report = SchedulerReport()  # a fresh report shows every gauge
    _, gauges, _ = h.sched_half.stats_report()
    assert gauges[key("l3_breaker_state")] == planner.breaker_gauge() == 1
    assert planner.breaker_status() == {"state": "tripped", "trips": 1}
    health.resume()
    h.step()
    forget_l1_and_l2(h)
    h.add("b", tokens)  # nothing in L3 yet: computed, and now backed up
    h.run()
    h.step()
    assert h.first_computed["b"] == 0 and num_pages_stored(store) == 5
    forget_l1_and_l2(h)
    h.add("c", tokens)
    h.run()
    assert h.first_computed["c"] == 5 * BLOCK and planner.prefetched_blocks == 5
    assert h.load_checks and all(h.load_checks)
    assert_clean(h)


def test_a_trip_stops_waits_and_drops_the_backlog(tiny_model_dir, monkeypatch):
    """A request waiting (wait_complete) on a lookup the store never answers
    goes on at the next step after the trip; deferred backups are dropped
    and counted."""
    h, _ = l3_harness(tiny_model_dir, policy="wait_complete")
    health = with_fake_health(h)
    planner = h.sched_half.l3
    gate = threading.Event()
    monkeypatch.setattr(planner.lookups, "_exists", lambda hashes: gate.wait(10) and 0)
    try:
        h.add("a", prompt(41, 4 * BLOCK + 1), max_tokens=1)
        for _ in range(5):
            h.step(complete_async=False)
        assert "a" not in h.first_computed  # waits for its lookup
        planner.backups.backlog.defer([bytes([i]) * 32 for i in range(3)], (0, 1, 2))
        health.trip()
        start = time.monotonic()
        while "a" not in h.first_computed and time.monotonic() - start < 5:
            h.step(complete_async=False)
        assert h.first_computed["a"] == 0 and time.monotonic() - start < 2
        assert len(planner.backups.backlog) == 0
        # The 3 deferred ones, and the 4 blocks "a" computed, not backed up.
        assert planner_samples(planner)[key("store_skipped_blocks", "L3", "breaker")] == 3 + 4
    finally:
        gate.set()
    h.run()
    assert_clean(h)


def test_the_backfill_of_an_attach_pauses_while_tripped(tiny_model_dir, monkeypatch):
    from tests.admin.test_storage_control import control, drain, mem_spec, settle
    from tests.connector import mem_backend
    from tests.connector.harness import make_harness
    from vllm_hicache.admin import clear as admin_clear

    # One page a step, so the backfill is still under way when the breaker trips
    # (a live attach may plan its first backfill in the step that answers).
    monkeypatch.setattr(admin_clear, "BACKFILL_PAGES_PER_STEP", 1)

    h = make_harness(tiny_model_dir)
    h.add("a", prompt(42, 5 * BLOCK + 3))
    h.add("b", prompt(43, 3 * BLOCK + 1))
    h.run()
    store = uuid.uuid4().hex
    status, body = settle(h, control(h).submit("attach", mem_spec(store)))
    assert status == 200, body
    health = with_fake_health(h)
    health.trip()
    data = mem_backend.STORES[store]
    before = num_pages_stored(data)
    for _ in range(10):
        h.step()
    assert num_pages_stored(data) == before < 8
    health.resume()
    drain(h)
    assert num_pages_stored(data) == 8
