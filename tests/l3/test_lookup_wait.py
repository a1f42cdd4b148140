"""A lookup answers in the schedule pass that issued it when the store is
fast (l3/planner.py, must_wait): a miss is not held back a step; a slow
store costs a pass at most its budget, whatever the number of requests."""

from __future__ import annotations

import threading
import time
import uuid

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from vllm_hicache.common.page_ops import PageOps
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3 import lookups as lookups_module
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.policy.eviction import make_eviction_policy
from vllm_hicache.storage import StorageContext

CHAIN = tuple(bytes([i]) * 32 for i in range(4))


def planner(answer_after_s: float, hit: int, policy: str = "wait_complete") -> L3Planner:
    storage = make_config(
        hicache_storage_backend="file", hicache_storage_prefetch_policy=policy,
        hicache_storage_backend_extra_config={"prefetch_threshold": 16}).storage
    assert storage.prefetch_policy == policy
    backend = MemBackend({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 1, 64))
    tree = HiRadixTree(8, make_eviction_policy("lru"))
    p = L3Planner(storage, backend, [], 16, world_size=1, max_inflight_pages=8,
                  ctx=PlannerContext(tree, PageOps(tree), lambda c, m, n: tree.alloc(n)))
    release = threading.Event()

    def exists(hashes):
        release.wait(answer_after_s)
        return hit

    p.lookups._exists = exists  # type: ignore[method-assign]
    p.release = release  # type: ignore[attr-defined]
    return p


def test_a_fast_miss_is_seen_in_the_pass_that_looked_it_up():
    p = planner(answer_after_s=0.0005, hit=0)
    p.start_lookup("r", CHAIN, 0)
    assert not p.must_wait("r")  # answered within the pass: no step lost
    p.close()


def test_a_fast_hit_is_prefetched_by_the_same_step():
    p = planner(answer_after_s=0.0005, hit=4)
    p.start_lookup("r", CHAIN, 0)
    assert p.must_wait("r")  # it waits for its prefetch...
    deadline = time.monotonic() + 5
    while not p.lookups.has_finished() and time.monotonic() < deadline:
        time.sleep(0.0001)  # (the completion callback runs just after the answer)
    (job,) = p.plan_prefetches()  # ...which leaves with this very step
    assert len(job.pages) == 4
    p.close()


def test_a_slow_store_costs_a_pass_at_most_its_budget():
    p = planner(answer_after_s=10.0, hit=4)
    for i in range(20):
        p.start_lookup(f"r{i}", CHAIN, 0)
    started = time.monotonic()
    assert all(p.must_wait(f"r{i}") for i in range(20))
    elapsed = time.monotonic() - started
    assert elapsed < lookups_module.LOOKUP_WAIT_PER_STEP_S + 0.05, elapsed
    p.plan_prefetches()  # the next pass has its budget again
    started = time.monotonic()
    assert p.must_wait("r0")
    assert time.monotonic() - started >= lookups_module.LOOKUP_WAIT_PER_STEP_S * 0.9
    p.release.set()
    p.close()


def test_best_effort_never_blocks():
    p = planner(answer_after_s=10.0, hit=4, policy="best_effort")
    p.start_lookup("r", CHAIN, 0)
    started = time.monotonic()
    assert not p.must_wait("r")
    assert time.monotonic() - started < 0.001 + 0.05
    p.release.set()
    p.close()
