"""The nixl backend's staging pool (staging.py): NIXL never sees the caller's memory.

Late transfers (parked past their deadline) are in test_backend.py and
test_obj.py; here: what is registered, and the pool's bounds.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.storage.conformance import OBJECT_BYTES, empty, keys, obj, same
from tests.storage.nixl.test_backend import built, overlaps, posix_spec  # noqa: F401 - fixture
from vllm_hicache.storage.nixl.staging import StagingSlots

pytestmark = pytest.mark.timeout(120)


def test_caller_memory_is_never_registered(tmp_path, built, monkeypatch):
    """Transfers use the staging arenas, registered once: the host pool handed to
    register_memory, pool pages and headers are never registered."""
    b = built(posix_spec(tmp_path))
    pool = np.zeros(4 * (OBJECT_BYTES - 64), np.uint8)
    calls = []
    real = b._engine.agent.register_memory
    monkeypatch.setattr(b._engine.agent, "register_memory",
                        lambda descs, mem, *a: calls.append((mem, descs)) or real(descs, mem, *a))
    b.register_memory(pool)
    pages = pool.reshape(4, -1)
    ks = keys(2)
    sources = [obj(0), obj(1)]
    pages[0][:], pages[1][:] = sources[0][1], sources[1][1]
    headers = [np.zeros(64, np.uint8), np.zeros(64, np.uint8)]
    for _ in range(2):
        assert b.put(ks, [[sources[0][0], pages[0]], [sources[1][0], pages[1]]]) == [True, True]
        assert b.get(ks, [[headers[0], pages[2]], [headers[1], pages[3]]]) == [True, True]
    assert same([headers[0], pages[2]], sources[0]) and same([headers[1], pages[3]], sources[1])
    dram = [d for mem, descs in calls if mem == "DRAM" for d in descs]
    assert len(dram) == 1 and dram[0][1] == b.stats()["staging_bytes"], dram
    assert not overlaps(dram, [pool, *headers, *(s[0] for s in sources)])


def test_exhausted_staging_is_a_miss_not_an_overwrite(tmp_path, built):
    b = built(posix_spec(tmp_path))
    b._staging.max_bytes = 2 * b._staging.slot_bytes
    ks = keys(3)
    assert b.put(ks, [obj(i) for i in range(3)]) == [True, True, False]
    targets = [empty() for _ in range(2)]
    assert b.get(ks[:2], targets) == [True, True]
    assert same(targets[0], obj(0)) and same(targets[1], obj(1))
    assert b.stats()["staging_bytes"] == 2 * b._staging.slot_bytes


class _Engine:
    def __init__(self):
        self.regions = []

    def register_region(self, region):
        self.regions.append(region)


def test_pool_grows_by_doubling_up_to_its_cap():
    engine = _Engine()
    pool = StagingSlots(engine, 1 << 20)  # 1 MiB objects: cap 1 GiB, first arena 64 MiB
    assert pool.slot_bytes == 1 << 20 and pool.max_bytes == 1 << 30
    taken = [pool.take(1000) for _ in range(65)]
    assert [a.nbytes for a in engine.regions] == [64 << 20, 64 << 20]
    taken += [pool.take(1 << 20) for _ in range(1024 - 65)]
    assert all(t is not None for t in taken) and pool.take(1) is None
    assert [a.nbytes >> 20 for a in engine.regions] == [64, 64, 128, 256, 512]
    assert len({t.ctypes.data for t in taken}) == 1024
    pool.give(taken.pop())
    assert pool.take(5) is not None and pool.take(5) is None
    big = pool.take((1 << 20) + 1)  # larger than a slot: a buffer of its own
    assert big.nbytes == (1 << 20) + 1 and len(engine.regions) == 5
    pool.give(big)
    assert pool.take(5) is None


def test_retired_slot_never_returns_to_the_pool():
    pool = StagingSlots(_Engine(), 1 << 20)
    slot = pool.take(10)
    pool.retire(slot)
    pool.give(slot)
    assert all(pool.take(10).ctypes.data != slot.ctypes.data for _ in range(63))
    assert pool.nbytes == 64 << 20
