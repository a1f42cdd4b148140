"""The staging area (storage/mooncake/memory.py) without Mooncake: bounded
slots, leases that wait (bounded) and never share a slot, chunk plans."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from vllm_hicache.storage.mooncake.memory import (
    StagingArea,
    fits,
    object_lengths,
    plan_chunk,
    slot_bytes_for,
)


def area(slots: int = 3, slot_bytes: int = 128) -> tuple[StagingArea, list[np.ndarray]]:
    registered: list[np.ndarray] = []
    return StagingArea(slots, slot_bytes, lambda buf: registered.append(buf) or True), registered


def test_one_region_of_slots_is_registered_once():
    staging, registered = area(3, 128)
    assert len(registered) == 1 and registered[0] is staging.buffer
    assert staging.nbytes == 3 * 128
    assert slot_bytes_for(64 + 4096) == 64 + 4096 and slot_bytes_for(65) == 128


def test_a_refused_registration_fails_construction():
    with pytest.raises(OSError, match="cannot register the 256-byte staging area"):
        StagingArea(2, 128, lambda buf: False)


def test_leases_are_bounded_and_never_share_a_slot():
    staging, _ = area(3, 128)
    with staging.lease(10) as first:
        assert len(first) == 3  # all there is, not 10
        with pytest.raises(TimeoutError, match="no staging slot free"):
            with staging.lease(1, timeout_s=0.05):
                pass
    with staging.lease(2) as a, staging.lease(5) as b:
        assert len(a) == 2 and len(b) == 1
        starts = {v.ctypes.data for v in a + b}
        assert len(starts) == 3
        for view in a + b:
            assert staging.buffer.ctypes.data <= view.ctypes.data
            assert view.ctypes.data + view.nbytes <= staging.buffer.ctypes.data + staging.nbytes


def test_a_waiting_lease_gets_the_slot_when_it_frees():
    staging, _ = area(1, 64)
    got: list[int] = []

    def wait() -> None:
        with staging.lease(1) as slots:
            got.append(len(slots))

    with staging.lease(1):
        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.1)
        assert not got  # still waiting
    waiter.join(5)
    assert got == [1]


def test_plan_lays_objects_contiguously_and_passes_over_misfits():
    staging, _ = area(2, 128)
    header, body = np.arange(64, dtype=np.uint8), np.arange(60, dtype=np.uint8)
    big = [np.zeros(64, np.uint8), np.zeros(100, np.uint8)]  # 164 B: no slot holds it
    empty = [np.zeros(0, np.uint8)]
    objects = [big, [header, body], empty, [header, np.zeros(0, np.uint8), body], [header]]
    lengths = object_lengths(objects)
    assert fits(lengths, 128) == [False, True, False, True, True]
    with staging.lease(3) as slots:
        chunk = plan_chunk(objects, lengths, 0, slots)
        assert chunk.sent == [1, 3] and chunk.hi == 4  # two slots: object 4 waits
        assert chunk.sizes == [124, 124]
        assert chunk.ptrs == [slots[0].ctypes.data, slots[1].ctypes.data]
        for _, src, view in chunk.views():
            view[...] = src
        assert slots[0][:124].tobytes() == header.tobytes() + body.tobytes()
        assert [p for p, _, _ in chunk.views()] == [0, 0, 1, 1]  # the empty buffer: no copy
        rest = plan_chunk(objects, lengths, chunk.hi, slots)
        assert rest.sent == [4] and rest.hi == 5
