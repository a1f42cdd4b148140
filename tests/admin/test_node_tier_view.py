"""The admin API's GET with a node tier in front of the remote store:
``tiers.node.instance`` counts this instance's node-hit tokens and the
pages its worker sealed into the tier, as the planner's NODE events saw
them (l3/node_events.py), next to the scheduler's hit counters."""

from __future__ import annotations

import uuid

from tests.admin.test_storage_control import control, settle
from tests.connector.harness import BLOCK, make_harness
from tests.l3.test_planner import forget_l1_and_l2
from tests.scheduler.test_scheduler import prompt


def node_harness(tiny_model_dir, node_root, name: str, **overrides):
    """An instance with a node tier in front of an in-memory L3 (a fresh one
    each call), keyword overrides on top."""
    settings = dict(
        max_num_seqs=8, hicache_storage_backend="dynamic",
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_backend_extra_config={
            "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
            "store": uuid.uuid4().hex, "prefetch_threshold": BLOCK},
        node_tier_name=f"{name}-{uuid.uuid4().hex[:8]}", node_tier_root=node_root)
    settings.update(overrides)
    return make_harness(tiny_model_dir, **settings)


def test_get_shows_this_instances_node_hits_and_stored_pages(tiny_model_dir, node_root):
    h = node_harness(tiny_model_dir, node_root, "view", node_tier_bytes=8 << 20)
    try:
        tokens = prompt(20, 4 * BLOCK + 3)
        h.add("a", tokens)
        h.run()
        h.step()  # the last acks and tier changes in
        forget_l1_and_l2(h)
        h.add("b", tokens)
        h.run()
        status, body = settle(h, control(h).submit("get"))
        assert status == 200
        node = body["tiers"]["node"]
        sched = h.sched_half
        assert sched.stats.hit_tokens_l3 == 4 * BLOCK
        assert node["instance"]["hit_tokens"] == sched.stats.hit_tokens_node == 4 * BLOCK
        # The four blocks, and the worker's start-up canary page (no block).
        assert node["instance"]["announced_stored_blocks"] == 4
        assert node["instance"]["stored_pages"] == 5 and node["instance"]["unnamed_pages"] == 1
        assert node["instance"]["evicted_pages"] == 0 and node["used_bytes"] > 0
    finally:  # leave the tier before its directory goes
        h.worker.worker.shutdown()
        h.sched_half.l3.close()


def test_get_page_counts_are_exact_when_reports_repeat_or_get_lost(tiny_model_dir, node_root):
    """A tier of a few pages, so stores evict: every step's worker report
    reaches the scheduler merged with a copy of itself (vLLM merging a
    rank's report twice), and every other one without its node counts (a
    lost report); once the workload is done, the GET's page counts are
    still exactly what the processes' stores did (common/node_counts.py)."""
    import copy

    steps = iter(range(1 << 30))

    def repeat_or_lose(meta):
        if meta is None:
            return None
        meta = meta.aggregate(copy.deepcopy(meta))
        if next(steps) % 2 and losing:
            meta.node_tier_counts = {}
        return meta

    losing = True
    h = node_harness(tiny_model_dir, node_root, "exact", node_tier_bytes=384 << 10)
    h.worker_meta_filter = repeat_or_lose
    try:
        backends = (h.worker.worker._io.pages.backend, h.sched_half.l3.backend)
        slots = backends[0].tier.stats().num_slots
        for i in range(4):
            h.add(f"r{i}", prompt(30 + i, (slots // 2 + 1) * BLOCK + 3))
            h.run()
        losing = False
        for _ in range(3):  # the last reports in, none lost
            h.step()
        status, body = settle(h, control(h).submit("get"))
        assert status == 200
        got = body["tiers"]["node"]["instance"]
        truth = [sum(int(b.counts()[c]) for b in backends)
                 for c in ("inserts", "promotions", "evictions")]
        assert [got["stored_pages"], got["promoted_pages"], got["evicted_pages"]] == truth
        assert truth[0] > slots and truth[2] > 0
    finally:  # leave the tier before its directory goes
        h.worker.worker.shutdown()
        h.sched_half.l3.close()
