"""Where an L3 hit's wait goes (l3/hit_stages.py): each stage is attributed
the time between its own two points, on a fake clock, through the planner's
real lookup, prefetch and commit, and the stages sum to the wait."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from vllm_hicache.common.jobs import PrefetchProgress, PrefetchTiming
from vllm_hicache.common.page_ops import PageOps
from vllm_hicache.common.stats import key
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3 import planner as planner_module
from vllm_hicache.l3.hit_stages import STAGES, WAIT_STAGES, HitTimes, wait_stages
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.policy.eviction import make_eviction_policy
from vllm_hicache.scheduler.hit_timer import HitStageTimer
from vllm_hicache.storage import StorageContext

CHAIN = tuple(bytes([i]) * 32 for i in range(4))


class FakeClock:
    """``time.monotonic`` under the test's control; each read advances it by ``tick``."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.tick = 0.0

    def monotonic(self) -> float:
        value = self.now
        self.now += self.tick
        return value


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock(100.0)
    monkeypatch.setattr(planner_module.time, "monotonic", fake.monotonic)
    return fake


def planner_with_held_lookup(world_size: int = 1):
    storage = make_config(hicache_storage_backend="file",
                          hicache_storage_backend_extra_config={"prefetch_threshold": 16}
                          ).storage
    backend = MemBackend({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 1, 64))
    tree = HiRadixTree(8, make_eviction_policy("lru"))
    ops = PageOps(tree)

    def alloc(chain, matched, num):
        return tree.alloc(num)

    planner = L3Planner(storage, backend, [], 16, world_size=world_size,
                        max_inflight_pages=8, ctx=PlannerContext(tree, ops, alloc))
    gate = threading.Event()
    # No namespaces: the store "has" every block; the lookup answers when let go.
    planner.lookups._exists = lambda hashes: gate.wait(10) and len(hashes)  # type: ignore[method-assign]
    return planner, tree, gate


def wait_answered(planner: L3Planner) -> None:
    deadline = time.monotonic() + 10
    while not planner.lookups.has_finished():
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.001)


def test_each_stage_gets_the_time_between_its_points(clock):
    planner, tree, gate = planner_with_held_lookup(world_size=2)
    planner.start_lookup("r", CHAIN, 0)                    # issued at 100
    clock.now = 100.5
    gate.set()
    wait_answered(planner)                                 # answered at 100.5
    clock.now = 101.0
    (job,) = planner.plan_prefetches()                     # planned at 101
    clock.now = 101.5
    # Rank 1 finishes first; its timing arrives before its progress.
    planner.on_worker_meta(HiCacheWorkerMetadata(
        prefetch_timing={job.op_id: {1: PrefetchTiming(0.05, 0.1, 0.02)}},
        prefetch={job.op_id: {1: PrefetchProgress(4, True)}}))
    assert planner.hit_stages("r", 101.5)["l2_insert"] == 0  # not committed yet
    clock.now, clock.tick = 102.0, 0.25
    # The slowest rank (largest total) is the one the request waited for.
    planner.on_worker_meta(HiCacheWorkerMetadata(
        prefetch_timing={job.op_id: {0: PrefetchTiming(0.1, 0.3, 0.05)}},
        prefetch={job.op_id: {0: PrefetchProgress(4, True)}}))  # seen 102, committed 102.25
    assert tree.match(CHAIN).num_blocks == 4
    stages = planner.hit_stages("r", 103.0)
    assert stages == pytest.approx({
        "lookup": 0.5, "lookup_seen": 0.5, "queue": 0.1, "io": 0.3, "seal_check": 0.05,
        "step_wait": 1.0 - 0.45, "l2_insert": 0.25, "load_wait": 0.75})
    assert list(stages) == list(WAIT_STAGES)
    assert sum(stages.values()) == pytest.approx(3.0)  # admitted - issued
    planner.close()


def test_no_stages_without_a_prefetch_of_its_own(clock):
    planner, _tree, gate = planner_with_held_lookup()
    gate.set()
    assert planner.hit_stages("never-looked-up", 100.0) is None
    planner.start_lookup("r", CHAIN, 0)
    wait_answered(planner)
    assert planner.hit_stages("r", 100.0) is None  # answered, nothing planned yet
    planner.close()


def test_points_not_reached_give_their_time_to_the_next_stage():
    times = HitTimes(issued=10.0, answered=10.2, planned=10.4)  # admitted before the commit
    stages = wait_stages(times, 11.0)
    assert stages["step_wait"] == pytest.approx(0.6)
    assert stages["l2_insert"] == stages["load_wait"] == 0.0
    assert sum(stages.values()) == pytest.approx(1.0)


def test_worker_durations_longer_than_their_interval_are_scaled_to_fit():
    times = HitTimes(10.0, 10.0, 10.0, seen=10.1, committed=10.1,
                     timing=PrefetchTiming(0.1, 0.1, 0.0))
    stages = wait_stages(times, 10.1)
    assert stages["queue"] == pytest.approx(0.05) and stages["io"] == pytest.approx(0.05)
    assert stages["step_wait"] == 0.0
    assert all(v >= 0 for v in stages.values())
    assert sum(stages.values()) == pytest.approx(0.1)


def test_timer_observes_the_wait_and_the_load_when_its_step_comes_back():
    timer = HitStageTimer()
    stages = dict.fromkeys(WAIT_STAGES, 0.01)
    timer.admitted("layerwise", stages, step=1, async_load=False, now=5.0)
    timer.admitted("async", stages, step=1, async_load=True, now=5.0)
    timer.step_done(now=5.5)                        # step 0's output
    timer.step_done(now=6.0)                        # step 1's: the layerwise load ran in it
    timer.step_done(["async"], now=7.0)
    observed = timer.take()
    assert observed[key("l3_hit_stage_seconds", "load")] == [1.0, 2.0]
    assert all(observed[key("l3_hit_stage_seconds", s)] == [0.01, 0.01] for s in WAIT_STAGES)
    assert set(observed) == {key("l3_hit_stage_seconds", s) for s in STAGES}
    assert timer.take() == {}
