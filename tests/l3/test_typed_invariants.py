"""What the L3 tier does where its types say a value may be missing: a
lookups-only planner (no PlannerContext) refuses to plan or complete page
ops by name, and a prepare command without storage keys is refused by name
(its ack carries the error) without building a client, as is a commit
of a generation never prepared."""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from vllm_hicache.common.jobs import StorageCommand
from vllm_hicache.common.page_ops import PinnedRange
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.l3.attach_worker import RankL3
from vllm_hicache.l3.planner import L3Planner
from vllm_hicache.storage import StorageContext


@pytest.fixture
def lookups_only():
    storage = make_config(hicache_storage_backend="file",
                          hicache_storage_backend_extra_config={}).storage
    backend = MemBackend({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 1, 64))
    planner = L3Planner(storage, backend, [], 16, world_size=1, max_inflight_pages=8)
    yield planner
    planner.close()


def test_a_planner_without_context_looks_up_but_plans_nothing(lookups_only):
    assert lookups_only.ctx is None
    assert lookups_only.plan_prefetches() == []  # nothing finished: nothing to plan
    stored = [PinnedRange((b"\x01" * 32,), (0,), (3,))]
    with pytest.raises(RuntimeError, match="without a PlannerContext"):
        lookups_only.backups.plan_backup(stored, step=1)
    with pytest.raises(RuntimeError, match="without a PlannerContext"):
        lookups_only.on_worker_meta(HiCacheWorkerMetadata())


def test_a_prepare_without_storage_keys_is_refused_by_name():
    built = []
    rank = RankL3(None, None, worker_id=3)
    rank.run(StorageCommand(5, "prepare", {}, generation=1), lambda *args: built.append(args))
    assert not built
    assert rank.io is None and rank.storage is None
    assert "names no hicache_storage_* keys" in rank.acks[5][3]
    rank.run(StorageCommand(6, "commit", generation=1), lambda *args: built.append(args))
    assert "no client was prepared for backend generation 1" in rank.acks[6][3]
    rank.run(StorageCommand(7, "launch"), lambda *args: built.append(args))
    assert "unknown storage command 'launch'" in rank.acks[7][3]
