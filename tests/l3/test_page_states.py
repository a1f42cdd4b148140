"""L3 prefetches of a model with a state group: the pages a prefetch indexes
get their state flags from the objects, valid only where every rank's object
said so (a page is only as good as its worst rank)."""

from __future__ import annotations

import uuid

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from vllm_hicache.common.jobs import PrefetchProgress
from vllm_hicache.common.page_ops import PageOps
from vllm_hicache.common.page_states import PageStates
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.l3.prefetch_ops import PrefetchOp
from vllm_hicache.policy.eviction import make_eviction_policy
from vllm_hicache.storage import StorageContext

CHAIN = tuple(bytes([i]) * 32 for i in range(4))


def test_prefetched_pages_are_valid_only_where_every_rank_says_so():
    storage = make_config(hicache_storage_backend="file",
                          hicache_storage_backend_extra_config={}).storage
    backend = MemBackend({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 2, 64))
    states = PageStates(8)
    tree = HiRadixTree(8, make_eviction_policy("lru"))
    ops = PageOps(tree)
    planner = L3Planner(storage, backend, [], 16, world_size=2, max_inflight_pages=8,
                        ctx=PlannerContext(tree, ops), page_states=states)
    pages = tree.alloc(4)
    planner.prefetches._ops[7] = PrefetchOp(7, CHAIN, 0, list(pages))

    def report(rank, done, finished, valid):
        meta = HiCacheWorkerMetadata(
            prefetch={7: {rank: PrefetchProgress(done, finished, frozenset(valid))}})
        planner.on_worker_meta(meta)

    report(0, 4, True, {1, 3})
    assert tree.match(CHAIN).num_blocks == 0  # rank 1 has not reported
    report(1, 2, False, {0, 1})
    assert tree.match(CHAIN).pages == pages[:2]
    assert [states.valid(p) for p in pages[:2]] == [False, True]
    report(1, 4, True, {2, 3})  # cumulative: rank 1 now says {0, 1, 2, 3}
    assert tree.match(CHAIN).pages == pages
    assert [states.valid(p) for p in pages] == [False, True, False, True]
    assert states.usable(pages) == 4 and states.usable(pages[:3]) == 2
    assert not planner.in_flight()["prefetches"]
