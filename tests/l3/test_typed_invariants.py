"""What the L3 tier does where its types say a value may be missing: a
lookups-only planner (no PlannerContext) refuses to plan or complete page
ops by name, and an attach command without storage keys is refused by name
(its ack carries the error) without building a client."""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import make_config
from tests.connector.mem_backend import MemBackend
from vllm_hicache.common.jobs import StorageCommand
from vllm_hicache.common.page_ops import PinnedRange
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.l3.attach_worker import run_storage_command
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
        lookups_only.plan_backup(stored, step=1)
    with pytest.raises(RuntimeError, match="without a PlannerContext"):
        lookups_only.on_worker_meta(HiCacheWorkerMetadata())


def test_an_attach_without_storage_keys_is_refused_by_name():
    built = []
    held = run_storage_command(StorageCommand(5, "attach", {}), None, None,
                               lambda *args: built.append(args), worker_id=3)
    assert not built
    assert held.io is None and held.storage is None
    assert "names no hicache_storage_* keys" in held.ack[5][3]
