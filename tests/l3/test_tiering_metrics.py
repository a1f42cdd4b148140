"""The L2 -> L3 boundary's counters as metric samples (common/stats.py,
``tiering_samples``): blocks the L3 admission rule declined (inclusive:
when stored; exclusive: when L2 evicted them), admitted later by a hit,
exclusive mode's victim writes and promotions, the write budget in bytes.
Each reaches Prometheus through the same SchedulerReport as every other
counter (tests/connector/test_metrics.py)."""

from __future__ import annotations

import uuid

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from tests.l3.test_tiering import Rig, backed, chain
from tests.l3.test_write_budget_planner import BLOCK_BYTES, planner_with, stored
from vllm_hicache.common.page_ops import PageOps
from vllm_hicache.common.stats import HiCacheStats, SchedulerReport, key, planner_samples
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.policy.admission import L3Mode
from vllm_hicache.policy.eviction import make_eviction_policy


def test_inclusive_declines_and_late_admissions_are_samples():
    rig = Rig(16, "hits:2")
    a = chain(1, 3)
    rig.end_step(rig.store(a))
    rig.planner.backups.note_use(a[:2])
    assert backed(rig.end_step([])) == list(a[:2])
    samples = planner_samples(rig.planner)
    assert samples[key("admission_declined_blocks", "L3", "hits")] == 3
    assert samples[key("l3_admitted_late_blocks")] == 2
    # Not exclusive, no budget: those series stay absent.
    assert not any(k.startswith(("l3_exclusive_blocks.", "l3_write_budget_bytes."))
                   for k in samples)


def test_exclusive_counts_victims_written_declined_and_promoted():
    rig = Rig(16, "hits:2", mode=L3Mode.EXCLUSIVE)
    a, b = chain(1, 6), chain(2, 6)
    rig.end_step(rig.store(a))
    rig.planner.backups.note_use(a[:3])  # a's first three blocks: 2 uses
    rig.end_step(rig.store(b))
    jobs = rig.end_step(rig.store(chain(3, 4)))
    assert backed(jobs) == list(a[:3])
    samples = planner_samples(rig.planner)
    assert samples[key("l3_exclusive_blocks", "victim_written")] == 3
    # a[3:] left L2 unwritten: declined by the rule at eviction, not at store.
    assert samples[key("admission_declined_blocks", "L3", "hits")] == 3
    assert samples[key("l3_exclusive_blocks", "promoted")] == 0
    rig.planner.prefetches.prefetched_blocks += 2  # what a landing prefetch adds
    assert planner_samples(rig.planner)[key("l3_exclusive_blocks", "promoted")] == 2


def test_exclusive_victims_cut_by_the_budget_are_not_counted_as_written():
    storage = make_config(hicache_storage_backend="file", hicache_storage_backend_extra_config={
        "l3_write_budget_bytes_per_s": 100, "l3_write_burst_bytes": 250}).storage
    tree = HiRadixTree(8, make_eviction_policy("lru"))
    ops = PageOps(tree)
    planner = L3Planner(storage, MemBackend({"store": uuid.uuid4().hex}, {}), [], 16,
                        world_size=1, max_inflight_pages=8, ctx=PlannerContext(tree, ops),
                        mode=L3Mode.EXCLUSIVE, block_bytes=BLOCK_BYTES)
    planner.write_budget.clock = lambda: 0.0
    planner.write_budget._filled_at = 0.0
    rig = Rig.__new__(Rig)
    rig.tree, rig.ops, rig.planner, rig.step = tree, ops, planner, 0
    jobs = rig.end_step(rig.store(chain(1, 8)))  # every page held: the oldest go out
    samples = planner_samples(planner)
    assert samples[key("l3_exclusive_blocks", "victim_written")] == len(backed(jobs)) == 2
    assert samples[key("store_skipped_blocks", "L3", "write_budget")] > 0
    assert samples[key("l3_write_budget_bytes", "written")] == 2 * BLOCK_BYTES


def test_write_budget_bytes_written_and_skipped_by_reason():
    planner, tree, clock = planner_with(l3_write_budget_bytes_per_s=100,
                                        l3_write_burst_bytes=250)
    a = tuple(bytes([5, i]) * 16 for i in range(4))
    planner.plan_backups([stored(tree, a)], step=1)  # two fit, two skipped
    samples = planner_samples(planner)
    assert samples[key("l3_write_budget_bytes", "written")] == 2 * BLOCK_BYTES
    assert samples[key("l3_write_budget_bytes", "write_budget")] == 2 * BLOCK_BYTES
    assert samples[key("l3_write_budget_bytes", "daily_budget")] == 0


def test_scheduler_report_hands_them_on_as_increments():
    rig = Rig(16, "hits:2")
    report = SchedulerReport()
    stats = HiCacheStats()
    stats.record_store_declined("hits", 4)
    rig.end_step(rig.store(chain(1, 3)))
    counters, _ = report.take(stats, rig.planner, {})
    assert counters[key("admission_declined_blocks", "L3", "hits")] == 3
    assert counters[key("admission_declined_blocks", "L2", "hits")] == 4
    rig.end_step(rig.store(chain(2, 2)))
    counters, _ = report.take(stats, rig.planner, {})
    assert counters == {key("admission_declined_blocks", "L3", "hits"): 2}
