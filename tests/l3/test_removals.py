"""Exact L3 removals (l3/removals.py, the planner's announcements): removed
object keys map back to this engine's block hashes, and become BlockRemoved
for STORAGE after the step's acknowledgements; a block removed while its
backup is open is left out of that backup's BlockStored."""

from __future__ import annotations

import uuid

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from vllm_hicache.common.events import MEDIUM_L3, EventLog
from vllm_hicache.common.page_ops import PageOps, PinnedRange
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.canary import canary_hash, is_canary_key
from vllm_hicache.l3.planner import L3Planner, PlannerContext
from vllm_hicache.l3.removals import RemovedKeys
from vllm_hicache.policy.eviction import make_eviction_policy
from vllm_hicache.storage import StorageContext

HASHES = [bytes([7, i]) * 16 for i in range(4)]


def ns(rank=0, **kw) -> KeyNamespace:
    return KeyNamespace("m", "float32", "layer_first", 16, tp_size=2, tp_rank=rank, **kw)


def test_keys_of_any_rank_map_back_and_foreign_keys_are_ignored():
    removals = RemovedKeys([ns(0), ns(1)], skip=is_canary_key)
    keys = ns(1).object_keys(HASHES[:2]) + ns(0).object_keys(HASHES[1:3])
    other_model = KeyNamespace("other", "float32", "layer_first", 16, tp_size=2, tp_rank=0)
    keys += other_model.object_keys(HASHES) + ["not-a-key", "hc4-zz"]
    keys += ns(0).object_keys([canary_hash(ns(0))])
    assert removals.block_hashes(keys) == HASHES[:3]
    assert removals.unmapped == 0


def test_with_a_secret_only_names_noted_here_map_back():
    secret = dict(name_key=b"k" * 32, protection="gmac:t")
    removals = RemovedKeys([ns(0, **secret), ns(1, **secret)], max_names=4)
    removals.note(HASHES[:3])  # 6 names, 4 kept: HASHES[0]'s two are forgotten
    keys = ns(0, **secret).object_keys(HASHES)
    assert removals.block_hashes(keys) == HASHES[1:3]
    assert removals.unmapped == 2
    # Without the secret, the same block's key is another namespace's.
    assert removals.block_hashes(ns(0).object_keys(HASHES)) == []


def make_planner():
    storage = make_config(hicache_storage_backend="file",
                          hicache_storage_backend_extra_config={}).storage
    backend = MemBackend({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 2, 64))
    tree = HiRadixTree(16, make_eviction_policy("lru"))
    events = EventLog(True, 16)
    planner = L3Planner(storage, backend, [ns(0), ns(1)], 16, world_size=2,
                        max_inflight_pages=16, ctx=PlannerContext(tree, PageOps(tree),
                                                                  events=events))
    pages = tree.alloc(4)
    tree.insert(tuple(HASHES), pages)
    return planner, events, PinnedRange(tuple(HASHES), (0, 1, 2, 3), tuple(pages))


def of(events, kind, medium=MEDIUM_L3):
    return [e for e in events if type(e).__name__ == kind and e.medium == medium]


def test_a_removal_after_the_ack_follows_its_stored_event():
    planner, events, rng = make_planner()
    [job] = planner.plan_backups([rng], step=1)
    removed = set(ns(1).object_keys(HASHES[3:]))
    planner.on_worker_meta(HiCacheWorkerMetadata(backups={job.op_id: {0, 1}},
                                                 l3_removed_keys=removed))
    taken = events.take()
    assert [type(e).__name__ for e in taken] == ["StoredBlocks", "RemovedBlocks"]
    assert of(taken, "RemovedBlocks")[0].block_hashes == HASHES[3:]
    assert planner.l3_removed_blocks == 1


def test_a_block_removed_while_its_backup_is_open_is_not_announced_stored():
    planner, events, rng = make_planner()
    [job] = planner.plan_backups([rng], step=1)
    planner.on_worker_meta(HiCacheWorkerMetadata(
        backups={job.op_id: {0}}, l3_removed_keys=set(ns(0).object_keys(HASHES[1:2]))))
    planner.on_worker_meta(HiCacheWorkerMetadata(backups={job.op_id: {1}}))
    taken = events.take()
    assert [e.block_hashes for e in of(taken, "RemovedBlocks")] == [HASHES[1:2]]
    stored = {h for e in of(taken, "StoredBlocks") for h in e.block_hashes}
    assert stored == {HASHES[0], HASHES[2], HASHES[3]}


def test_removals_the_schedulers_own_client_heard_of_are_announced_each_step():
    planner, events, rng = make_planner()
    planner.backend.take_removed_keys = lambda: ns(0).object_keys(HASHES[:1])
    planner.plan_backups([], step=1)
    assert [e.block_hashes for e in of(events.take(), "RemovedBlocks")] == [HASHES[:1]]
