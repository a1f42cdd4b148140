"""NodeAdmission: the scheduler half's node-tier direct hits (node_hits.py),
with the tier's lookups counted so that the probe's reuse is visible."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.scheduler import node_hits
from vllm_hicache.scheduler.load_gate import TIER_NODE, LoadGate
from vllm_hicache.scheduler.node_hits import NodeAdmission
from vllm_hicache.scheduler.request_params import RequestControls
from vllm_hicache.scheduler.request_state import NodeProbe, ReqState

BLOCK = 16


class CountingHits:
    """Stands in for NodeHits: the tier holds the first ``held`` hashes."""

    def __init__(self, held: list[bytes]) -> None:
        self.held = set(held)
        self.calls: list[int] = []

    def prefix(self, hashes):
        self.calls.append(len(hashes))
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n


class Planner:
    def __init__(self) -> None:
        self.backend = object()
        self.namespaces = ["ns"]
        self.cfg = SimpleNamespace(encrypt=False)
        self.forgotten: list[str] = []

    def forget(self, req_id: str) -> None:
        self.forgotten.append(req_id)


class Gate:
    def __init__(self, loads: bool) -> None:
        self.loads = loads

    def load_node(self, start, num_tokens, num_pages):
        return self.loads


def _request(num_blocks: int, req_id: str = "r"):
    hashes = [bytes([i]) * 8 for i in range(num_blocks)]
    # One token past the last full block, so that every block is loadable.
    return SimpleNamespace(request_id=req_id, block_hashes=hashes,
                           num_tokens=num_blocks * BLOCK + 1)


@pytest.fixture
def tier(monkeypatch):
    """(admission, planner, hits): a node tier holding 6 blocks of _request."""
    hits = CountingHits(_request(6).block_hashes)
    made: list[object] = []

    def fake_node_hits_for(backend, namespaces, *args):
        made.append(backend)
        return hits

    monkeypatch.setattr(node_hits, "node_hits_for", fake_node_hits_for)
    admission = NodeAdmission(BLOCK, LoadGate("always", 1 << 16), "page_first", False, False)
    return admission, Planner(), hits, made


def test_no_planner_means_no_node_hits(tier):
    admission, _, hits, _ = tier
    state = ReqState(_request(8))
    assert admission.hits(None) is None
    assert admission.hit(None, state, 0, step=1) is None
    assert not admission.serves_arrival(None, state, state.request.block_hashes, 0, step=1)
    assert hits.calls == []


def test_the_arrivals_probe_serves_the_next_pass_without_a_second_lookup(tier):
    admission, planner, hits, _ = tier
    state = ReqState(_request(8))
    chain = tuple(state.request.block_hashes)
    assert admission.serves_arrival(planner, state, chain, 1, step=3)
    assert state.node_probe == NodeProbe(3, 1, 5)
    assert hits.calls == [7]
    assert admission.hit(planner, state, 1 * BLOCK, step=3) == 5 * BLOCK
    assert hits.calls == [7]  # the probe stood in for the lookup
    assert state.node_probe is None
    assert state.lookup.node_blocks == 5 and state.lookup.tier == TIER_NODE
    assert planner.forgotten == ["r"]  # not staged through L2 as well


def test_a_later_pass_or_another_start_looks_the_tier_up_again(tier):
    admission, planner, hits, _ = tier
    for step, start in ((4, 1), (3, 2)):  # a later step; vLLM's own hit grew
        state = ReqState(_request(8))
        admission.serves_arrival(planner, state, tuple(state.request.block_hashes), 1, step=3)
        hits.calls.clear()
        assert admission.hit(planner, state, start * BLOCK, step=step) == (6 - start) * BLOCK
        assert hits.calls == [8 - start]


def test_a_hit_stops_at_the_requests_load_cap(tier):
    admission, planner, _, _ = tier
    state = ReqState(_request(8))
    state.controls = RequestControls(max_load_tokens=3 * BLOCK)
    assert admission.hit(planner, state, 0, step=1) == 3 * BLOCK
    capped = ReqState(_request(8))
    capped.controls = RequestControls(max_load_tokens=0)
    assert not admission.serves_arrival(planner, capped, tuple(capped.request.block_hashes), 0, 1)
    assert admission.hit(planner, capped, 0, step=1) is None


def test_nothing_held_or_nothing_left_is_no_hit(tier):
    admission, planner, hits, _ = tier
    other = ReqState(_request(8))
    other.request.block_hashes = [b"x" * 8] * 8
    assert admission.hit(planner, other, 0, step=1) is None
    state = ReqState(_request(8))
    assert not admission.serves_arrival(planner, state, tuple(state.request.block_hashes), 8, 1)
    assert state.node_probe is None


def test_a_declined_hit_is_zero_tokens_and_counts_its_blocks(tier):
    admission, planner, _, _ = tier
    admission._gate = Gate(loads=False)
    state = ReqState(_request(8))
    assert admission.hit(planner, state, 0, step=1) == 0
    assert state.declined_blocks == 6 and state.lookup.node_blocks == 0


def test_admit_counts_the_hit_and_keeps_its_blocks_from_l2_stores(tier):
    admission, _, _, _ = tier
    state, stats = ReqState(_request(8)), HiCacheStats()
    job = admission.admit(state, [40, 41, 42], 2, 5, True, stats)
    assert job.block_ids == (40, 41, 42) and job.in_step
    assert job.hashes == tuple(state.request.block_hashes[2:5])
    assert state.hit_tokens_by_tier == (0, 3 * BLOCK)
    assert stats.hit_tokens_node == 3 * BLOCK
    assert state.num_planned == 5


def test_a_new_planner_is_judged_again(tier):
    admission, planner, hits, made = tier
    assert admission.hits(planner) is hits and admission.hits(planner) is hits
    other = Planner()
    assert admission.hits(other) is hits
    assert made == [planner.backend, other.backend]
