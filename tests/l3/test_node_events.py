"""NODE KV events and this instance's node tier counts (l3/node_events.py),
alone and through the planner: the tier changes a worker reports become
BlockStored once every shard of a block is sealed, BlockRemoved at the
first shard's eviction, for medium NODE with the tier's name as ownership,
and never STORAGE removals; the lookup says how much of a prefix the node
tier had (L3Planner.node_range)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.conftest import make_config
from tests.l3.test_removals import HASHES, ns, of
from tests.tmpfs import tmpfs_dir
from vllm_hicache.common.events import MEDIUM_L3, MEDIUM_NODE, EventLog
from vllm_hicache.common.node_counts import NodeTierCounts
from vllm_hicache.common.page_ops import PageOps
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.l3.node_events import NodeTierEvents
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.l3.removals import RemovedKeys
from vllm_hicache.node import NodeTier
from vllm_hicache.policy.eviction import make_eviction_policy
from vllm_hicache.storage import StorageContext
from vllm_hicache.storage.node_chain import NodeChainBackend
from vllm_hicache.storage.node_keys import EVICTED, PROMOTED, SEALED, node_key

SHARDS = [ns(0), ns(1)]


def nkeys(rank: int, hashes) -> list[bytes]:
    return [node_key(k) for k in ns(rank).object_keys(hashes)]


def changes(sealed=(), promoted=(), evicted=()) -> dict[str, list[bytes]]:
    return {SEALED: list(sealed), PROMOTED: list(promoted), EVICTED: list(evicted)}


def test_a_block_is_stored_once_every_shard_is_sealed_and_removed_at_the_first_eviction():
    events = EventLog(True, 16)
    node = NodeTierEvents("chat", SHARDS, RemovedKeys(SHARDS))
    node.apply(changes(sealed=nkeys(0, HASHES[:2])), events)
    assert events.take() == []  # rank 1's pages are not there yet
    node.apply(changes(sealed=nkeys(1, HASHES[:1]), promoted=nkeys(1, HASHES[1:2])), events)
    stored = events.take()
    assert [(e.block_hashes, e.parent_block_hash, e.medium, e.ownership) for e in stored] == [
        ([h], None, MEDIUM_NODE, "chat") for h in HASHES[:2]]
    node.apply(changes(evicted=nkeys(1, HASHES[:1]) + nkeys(0, HASHES[:1])), events)
    [removed] = events.take()
    assert (removed.block_hashes, removed.medium, removed.ownership) == (HASHES[:1], MEDIUM_NODE,
                                                                           "chat")
    # The page counts are given (common/node_counts.py), not taken from the changes.
    assert node.status(7, NodeTierCounts(3, 1, 2)) == {
        "hit_tokens": 7, "stored_pages": 3, "promoted_pages": 1,
        "evicted_pages": 2, "announced_stored_blocks": 2,
        "announced_removed_blocks": 1, "unnamed_pages": 0}


def test_an_eviction_forgets_the_shards_sealed_so_far():
    events = EventLog(True, 16)
    node = NodeTierEvents("chat", SHARDS, RemovedKeys(SHARDS))
    node.apply(changes(sealed=nkeys(0, HASHES[:1])), events)
    node.apply(changes(evicted=nkeys(0, HASHES[:1])), events)
    node.apply(changes(sealed=nkeys(1, HASHES[:1])), events)
    assert [type(e).__name__ for e in events.take()] == ["RemovedBlocks"]  # never stored


def test_pending_blocks_are_bounded():
    node = NodeTierEvents("chat", SHARDS, RemovedKeys(SHARDS), max_pending=2)
    node.apply(changes(sealed=nkeys(0, HASHES)), None)  # 4 blocks half sealed, 2 kept
    node.apply(changes(sealed=nkeys(1, HASHES[2:])), None)
    assert node.stored_blocks == 2
    node.apply(changes(sealed=nkeys(1, HASHES[:2])), None)
    assert node.stored_blocks == 2  # the two oldest half-sealed blocks were dropped


def test_the_start_up_canary_is_no_block():
    from vllm_hicache.l3.canary import canary_hash, is_canary_key
    events = EventLog(True, 16)
    node = NodeTierEvents("chat", SHARDS[:1], RemovedKeys(SHARDS[:1], skip=is_canary_key))
    node.apply(changes(sealed=nkeys(0, [canary_hash(ns(0))])), events)
    assert events.take() == [] and node.unnamed_pages == 1


def test_with_a_secret_only_blocks_noted_here_are_named():
    secret = dict(name_key=b"k" * 32, protection="gmac:t")
    shards = [ns(0, **secret)]
    removals = RemovedKeys(shards)
    removals.note(HASHES[:1])
    events = EventLog(True, 16)
    node = NodeTierEvents("chat", shards, removals)
    evicted = [node_key(k) for k in shards[0].object_keys(HASHES[:2])]
    node.apply(changes(evicted=evicted + [node_key("x-zz")]), events)
    assert [e.block_hashes for e in events.take()] == [HASHES[:1]]
    assert node.unnamed_pages == 2
    assert removals.unmapped == 0  # NODE pages are not STORAGE removals


@pytest.fixture
def chain():
    with tmpfs_dir("hicache-node-events-") as root:
        tier = NodeTier.join("chat", "events-test", 64 * 4160, 4160, root=str(root))
        backend = NodeChainBackend({}, StorageContext("scheduler", 0, 2, 4160), tier=tier)
        yield backend
        backend.close()


def make_planner(backend):
    storage = make_config(hicache_storage_backend="file",
                          hicache_storage_backend_extra_config={}).storage
    tree = HiRadixTree(16, make_eviction_policy("lru"))
    events = EventLog(True, 16)
    planner = L3Planner(storage, backend, SHARDS, 16, world_size=2, max_inflight_pages=16,
                        ctx=PlannerContext(tree, PageOps(tree), events=events))
    return planner, events


def test_the_planner_announces_worker_tier_changes_as_node_events_not_storage(chain):
    planner, events = make_planner(chain)
    keys = {SEALED + k.hex() for r in (0, 1) for k in nkeys(r, HASHES[:1])}
    keys |= {EVICTED + k.hex() for k in nkeys(0, HASHES[1:2])}
    planner.on_worker_meta(HiCacheWorkerMetadata(l3_removed_keys=keys))
    taken = events.take()
    assert [e.block_hashes for e in of(taken, "StoredBlocks", MEDIUM_NODE)] == [HASHES[:1]]
    assert [e.block_hashes for e in of(taken, "RemovedBlocks", MEDIUM_NODE)] == [HASHES[1:2]]
    assert of(taken, "RemovedBlocks", MEDIUM_L3) == [] and planner.l3_removed_blocks == 0


def test_a_lookup_records_how_much_of_the_prefix_the_node_tier_had(chain):
    planner, _ = make_planner(chain)
    for rank in (0, 1):
        chain.put(ns(rank).object_keys(HASHES[:2]), [[np.zeros(4160, np.uint8)]] * 2)
    found = [0]
    assert planner.lookups.run(tuple(HASHES), found) == 2 and found == [2]
    chain.put(ns(0).object_keys(HASHES[2:3]), [[np.zeros(4160, np.uint8)]])  # rank 0 only
    assert planner.lookups.run(tuple(HASHES), found) == 2 and found == [2]
    planner.start_lookup("r", tuple(HASHES), 1)
    deadline = time.monotonic() + 10
    while planner.lookups.get("r").node_found[0] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert planner.lookups.get("r").node_found == [1]  # blocks 1.. of the chain: block 1
    assert planner.node_range("r") is None  # no prefetch yet
