"""``prefetch_threshold``: under ``auto`` the load gate's cost model decides
whether a finished L3 lookup is fetched, whatever its length; a fixed number
of tokens decides by length alone, whatever the cost."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from vllm_hicache.common.page_ops import PageOps
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.policy.eviction import make_eviction_policy
from vllm_hicache.storage import StorageContext

BLOCK = 16
CHAIN = tuple(bytes([i + 1]) * 32 for i in range(6))


class FakeGate:
    """A load gate whose cost model answers ``worth``; it records what it was asked."""

    def __init__(self, worth: bool) -> None:
        self.worth = worth
        self.asked: list[tuple[int, int, int]] = []
        self.latencies: list[float] = []

    def prefetch_l3(self, start: int, num_tokens: int, num_pages: int) -> bool:
        self.asked.append((start, num_tokens, num_pages))
        return self.worth

    def wants_l3_sample(self) -> bool:
        return False

    def record(self, tier: str, loaded: bool, num_tokens: int) -> None:
        pass

    def observe_l3_latency(self, seconds: float) -> None:
        self.latencies.append(seconds)


def planner_with(threshold, gate: FakeGate | None) -> L3Planner:
    extra = {} if threshold is None else {"prefetch_threshold": threshold}
    storage = make_config(hicache_storage_backend="file",
                          hicache_storage_backend_extra_config=extra).storage
    backend = MemBackend({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 1, 64))
    ns = KeyNamespace("m", "float32", "layer_first", BLOCK, tp_size=1, tp_rank=0)
    # Every block of CHAIN is in L3.
    backend.data.update({k: b"x" for k in ns.object_keys(CHAIN)})
    tree = HiRadixTree(16, make_eviction_policy("lru"))
    planner = L3Planner(storage, backend, [ns], BLOCK, world_size=1, max_inflight_pages=16,
                        ctx=PlannerContext(tree, PageOps(tree), alloc=lambda c, m, n: tree.alloc(n),
                                           gate=gate))
    return planner


def lookup_then_plan(planner: L3Planner, start: int):
    planner.start_lookup("r", CHAIN, start)
    deadline = time.monotonic() + 10
    while not planner.lookups.has_finished() and time.monotonic() < deadline:
        time.sleep(0.001)
    return planner.plan_prefetches()


@pytest.mark.parametrize("worth", [True, False])
def test_auto_fetches_a_short_hit_where_the_cost_model_says_so(worth):
    gate = FakeGate(worth)
    planner = planner_with(None, gate)  # the default: auto
    jobs = lookup_then_plan(planner, start=3)  # 3 blocks, 48 tokens: far under 256
    assert gate.asked == [(3 * BLOCK, 3 * BLOCK, 3)]
    assert [len(j.hashes) for j in jobs] == ([3] if worth else [])
    assert planner.prefetch_not_worth == (0 if worth else 1)
    assert len(gate.latencies) == 1 and gate.latencies[0] >= 0  # the lookup's round trip
    planner.close()


def test_auto_without_a_gate_fetches_any_hit():
    planner = planner_with("auto", None)
    assert [len(j.hashes) for j in lookup_then_plan(planner, start=5)] == [1]
    planner.close()


@pytest.mark.parametrize("worth", [True, False])
def test_a_fixed_threshold_decides_by_length_alone(worth):
    gate = FakeGate(worth)
    planner = planner_with(4 * BLOCK, gate)
    assert lookup_then_plan(planner, start=3) == []  # 3 blocks < 4: not even looked up
    assert [len(j.hashes) for j in lookup_then_plan(planner, start=2)] == [4]
    assert gate.asked == [] and planner.prefetch_not_worth == 0
    planner.close()
