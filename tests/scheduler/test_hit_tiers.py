"""hit_tiers: an admitted hit split by the tier that held it, counted once
and answered once to vLLM's hit-source question."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.scheduler import hit_tiers
from vllm_hicache.scheduler.request_state import HitTokens, ReqState

BLOCK = 16


class Planner:
    """Stands in for L3Planner: the request's own prefetch brought blocks
    ``fetched``, of which the lookup found ``node`` in the node tier."""

    def __init__(self, fetched=None, node=None) -> None:
        self.fetched, self.node = fetched, node
        self.stage_asks: list[str] = []

    def prefetched_range(self, req_id):
        return self.fetched

    def node_range(self, req_id):
        return self.node

    def hit_stages(self, req_id, admitted):
        self.stage_asks.append(req_id)
        return {"lookup": 0.001}


def state() -> ReqState:
    return ReqState(SimpleNamespace(request_id="r"))


@pytest.mark.parametrize("l3, start, end, want", [
    (None, 0, 4, HitTokens(4 * BLOCK, 0)),
    (Planner(), 0, 4, HitTokens(4 * BLOCK, 0)),
    (Planner(fetched=(2, 6)), 0, 4, HitTokens(2 * BLOCK, 2 * BLOCK)),
    (Planner(fetched=(2, 6)), 2, 6, HitTokens(0, 4 * BLOCK)),
    (Planner(fetched=(6, 9)), 0, 4, HitTokens(4 * BLOCK, 0)),  # fetched past the hit
])
def test_an_l2_load_counts_what_its_own_prefetch_brought_as_l3(l3, start, end, want):
    stats, s = HiCacheStats(), state()
    hit_tiers.record_l2_load(stats, l3, s, start, end, BLOCK)
    assert (stats.hit_tokens_l2, stats.hit_tokens_l3) == want
    assert s.hit_tokens_by_tier == want
    assert stats.hit_tokens_node == 0


def test_node_tokens_are_counted_only_within_an_l3_part():
    stats = HiCacheStats()
    hit_tiers.record_l2_load(stats, Planner(fetched=(2, 6), node=(2, 4)), state(), 0, 6, BLOCK)
    assert stats.hit_tokens_node == 2 * BLOCK
    stats = HiCacheStats()  # a node range with no L3 part in the hit: not a node hit
    hit_tiers.record_l2_load(stats, Planner(fetched=None, node=(0, 4)), state(), 0, 4, BLOCK)
    assert stats.hit_tokens_node == 0


def test_the_split_is_answered_once_then_as_l2():
    s = state()
    hit_tiers.record(HiCacheStats(), s, HitTokens(BLOCK, 3 * BLOCK))
    assert hit_tiers.take(s, 4 * BLOCK) == {"L2": BLOCK, "L3": 3 * BLOCK}
    assert hit_tiers.take(s, 4 * BLOCK) == {"L2": 4 * BLOCK}


def test_a_split_of_another_length_or_no_record_is_answered_as_l2():
    s = state()
    hit_tiers.record(HiCacheStats(), s, HitTokens(0, 3 * BLOCK))
    assert hit_tiers.take(s, 2 * BLOCK) == {"L2": 2 * BLOCK}
    assert hit_tiers.take(None, BLOCK) == {"L2": BLOCK}
    assert hit_tiers.take(None, 0) == {}


def test_stages_are_asked_only_for_a_hit_its_own_prefetch_brought():
    l3 = Planner(fetched=(4, 8))
    assert hit_tiers.l3_hit_stages(l3, "r", 0, 4) is None
    assert hit_tiers.l3_hit_stages(None, "r", 0, 4) is None
    assert hit_tiers.l3_hit_stages(l3, "r", 0, 5) == {"lookup": 0.001}
    assert l3.stage_asks == ["r"]
