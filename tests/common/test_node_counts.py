"""An instance's node tier page counts (common/node_counts.py): per-process
tallies over replaced backends, per-worker running totals merged by the
latest, however vLLM merges, repeats or loses the reports; the sum equals
what the Prometheus counters got."""

from __future__ import annotations

import pickle

import pytest

from vllm_hicache.common.node_counts import (
    ZERO,
    InstanceNodeCounts,
    NodeCountTally,
    NodeTierCounts,
    merge_reports,
)
from vllm_hicache.common.stats import key
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata


class FakeBackend:
    """NodeChainBackend.counts(): cumulative since the backend was built."""

    def __init__(self) -> None:
        self.c = {"hits": 0, "inserts": 0, "promotions": 0, "evictions": 0}

    def counts(self) -> dict[str, float]:
        return dict(self.c)

    def bump(self, inserts: int = 0, promotions: int = 0, evictions: int = 0) -> None:
        self.c["inserts"] += inserts
        self.c["promotions"] += promotions
        self.c["evictions"] += evictions


def c(stored: int = 0, promoted: int = 0, evicted: int = 0) -> NodeTierCounts:
    return NodeTierCounts(stored, promoted, evicted)


def test_counts_refuse_what_is_not_a_count():
    for bad in (-1, 1.5, True, "3", None):
        with pytest.raises(ValueError, match="stored_pages must be a non-negative integer"):
            NodeTierCounts(stored_pages=bad)  # type: ignore[arg-type]


def test_a_tally_adds_a_replaced_backend_to_the_old_ones_and_feeds_the_counters_once():
    tally, a = NodeCountTally(), FakeBackend()
    tally.observe(object())  # no node tier: nothing
    assert tally.totals == ZERO
    a.bump(inserts=3, evictions=1)
    tally.observe(a)
    a.bump(promotions=2)
    tally.observe(a)
    assert tally.totals == c(3, 2, 1)
    assert tally.take_gained().samples() == {key("node_tier_stored_pages"): 3.0,
                                             key("node_tier_promoted_pages"): 2.0,
                                             key("node_tier_evicted_pages"): 1.0}
    assert tally.take_gained() == ZERO  # taken once
    # An admin attach builds a new backend: its counts start at 0 and add,
    # even when they are already above the old backend's.
    b = FakeBackend()
    b.bump(inserts=5)
    tally.observe(b)
    assert tally.totals == c(8, 2, 1) and tally.take_gained() == c(5)


def test_worker_reports_merge_by_the_latest_whatever_the_order_or_repeats():
    one = HiCacheWorkerMetadata(node_tier_counts={0: c(2, 0, 1)})
    one.aggregate(HiCacheWorkerMetadata(node_tier_counts={1: c(4)}))
    one.aggregate(HiCacheWorkerMetadata(node_tier_counts={0: c(1)}))  # an older report of 0
    one.aggregate(HiCacheWorkerMetadata(node_tier_counts={1: c(4)}))  # the same one twice
    assert one.node_tier_counts == {0: c(2, 0, 1), 1: c(4)}
    # It crosses processes (EngineCore <- workers).
    assert pickle.loads(pickle.dumps(one)).node_tier_counts == one.node_tier_counts


def test_the_instance_sums_each_workers_latest_totals_and_its_own_member():
    inst, own = InstanceNodeCounts(), FakeBackend()
    inst.on_report({0: c(2), 1: c(3, 1)})
    inst.on_report({0: c(5, 0, 2)})
    inst.on_report({0: c(4)})  # a late, older report: no step back
    own.bump(inserts=1)  # the scheduler's member: the health check's probe
    assert inst.own_samples(own) == {key("node_tier_stored_pages"): 1.0}
    assert inst.total(own) == c(5 + 3 + 1, 1, 2)
    assert inst.total() == inst.total(own)  # None observes nothing


def test_a_lost_report_is_made_good_by_the_next_one():
    into: dict[int, NodeTierCounts] = {}
    merge_reports(into, {0: c(1)})
    # The report of totals c(2) is lost; the next one carries c(3).
    merge_reports(into, {0: c(3)})
    assert into == {0: c(3)}


def test_reports_and_counters_agree_across_workers():
    """Each worker's tally feeds its counters and its reports; the instance's
    GET equals the counters' sum once the last report is in."""
    backends = [FakeBackend(), FakeBackend()]
    tallies = [NodeCountTally(), NodeCountTally()]
    inst, prometheus = InstanceNodeCounts(), {}
    for step in range(6):
        meta = None
        for rank, (backend, tally) in enumerate(zip(backends, tallies)):
            backend.bump(inserts=step % 3, promotions=rank, evictions=step // 2)
            tally.observe(backend)
            report = HiCacheWorkerMetadata(node_tier_counts={rank: tally.totals})
            meta = report if meta is None else meta.aggregate(report)
            if step % 2 == rank:  # the counters are taken at other moments
                for k, v in tally.take_gained().samples().items():
                    prometheus[k] = prometheus.get(k, 0) + v
        inst.on_report(meta.node_tier_counts)
    for tally in tallies:
        for k, v in tally.take_gained().samples().items():
            prometheus[k] = prometheus.get(k, 0) + v
    total = inst.total()
    assert total == c(2 * sum(s % 3 for s in range(6)), 6, 2 * sum(s // 2 for s in range(6)))
    assert total.samples() == prometheus
