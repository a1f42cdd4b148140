"""The L3 planner under a write budget: a step's backups are cut to what
the budget allows, the least valuable blocks skipped (never deferred) and
counted by the limit that skipped them; what is planned stays within it."""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from tests.fake_clock import FakeClock
from vllm_hicache.common.page_ops import PageOps, PinnedRange
from vllm_hicache.common.stats import key, planner_samples
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.policy.eviction import make_eviction_policy
from vllm_hicache.storage import StorageContext

BLOCK_BYTES = 100
A = tuple(bytes([1, i]) * 16 for i in range(4))
B = tuple(bytes([2, i]) * 16 for i in range(4))


def planner_with(block_bytes=BLOCK_BYTES, **budget) -> tuple[L3Planner, HiRadixTree, FakeClock]:
    storage = make_config(hicache_storage_backend="file",
                          hicache_storage_backend_extra_config=budget).storage
    backend = MemBackend({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 1, 64))
    tree = HiRadixTree(32, make_eviction_policy("lru"))
    planner = L3Planner(storage, backend, [], 16, world_size=1, max_inflight_pages=64,
                        ctx=PlannerContext(tree, PageOps(tree)), block_bytes=block_bytes)
    clock = FakeClock(0.0)
    planner.write_budget.clock = clock
    planner.write_budget._filled_at = clock.now
    return planner, tree, clock


def stored(tree: HiRadixTree, chain) -> PinnedRange:
    pages = tree.alloc(len(chain))
    tree.insert(chain, pages)
    return PinnedRange(chain, tuple(range(len(chain))), tuple(pages))


def written(jobs) -> list[bytes]:
    return [h for j in jobs for h in j.hashes]


def test_blocks_over_the_budget_are_skipped_shallowest_kept_and_counted():
    planner, tree, clock = planner_with(l3_write_budget_bytes_per_s=100,
                                        l3_write_burst_bytes=250)
    jobs = planner.plan_backups([stored(tree, A)], step=1)
    assert written(jobs) == list(A[:2])          # 250 bytes: two blocks, the prefix
    assert planner.budget_skipped_bandwidth == 2
    assert planner_samples(planner)[key("store_skipped_blocks", "L3", "write_budget")] == 2
    assert planner.plan_backups([stored(tree, B)], step=2) == []  # 50 bytes left: none
    assert planner.budget_skipped_bandwidth == 6
    assert len(planner.backups.backlog) == 0       # skipped, not deferred
    clock.now += 1.0                               # 150 bytes: one block
    assert written(planner.plan_backups([stored(tree, B[:1])], step=3)) == [B[0]]
    assert planner.write_budget.spent_bytes == 3 * BLOCK_BYTES


def test_a_used_block_outranks_an_unused_one():
    planner, tree, _ = planner_with(l3_write_budget_bytes_per_s=100,
                                    l3_write_burst_bytes=200)
    planner.backups.note_use(B[:1])
    jobs = planner.plan_backups([stored(tree, A), stored(tree, B)], step=1)
    assert written(jobs) == [A[0], B[0]]


def test_the_day_limit_counts_as_its_own_reason():
    planner, tree, clock = planner_with(l3_write_budget_bytes_per_day=300)
    assert written(planner.plan_backups([stored(tree, A)], step=1)) == list(A[:3])
    clock.now += 3600.0
    assert planner.plan_backups([stored(tree, B)], step=2) == []
    assert planner.budget_skipped_day == 5 and planner.budget_skipped_bandwidth == 0


def test_no_budget_writes_everything():
    planner, tree, _ = planner_with()
    assert written(planner.plan_backups([stored(tree, A)], step=1)) == list(A)
    assert planner.backups.budget_blocks() is None


def test_a_budget_below_one_block_is_refused_at_start():
    with pytest.raises(ValueError, match="below one block's L3 bytes"):
        planner_with(block_bytes=1000, l3_write_budget_bytes_per_s=500)
