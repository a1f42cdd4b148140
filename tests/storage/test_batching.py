"""Cutting batches: chunks bounded by count and bytes, slices on threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_hicache.storage.batching import batched, chunks, map_slices


@pytest.mark.parametrize("sizes, max_items, max_bytes, expected", [
    ([], 2, 10, []),
    ([1, 1, 1, 1, 1], 2, None, [(0, 2), (2, 4), (4, 5)]),
    ([4, 4, 4], None, 8, [(0, 2), (2, 3)]),
    # An item over the budget comes alone, whatever surrounds it.
    ([1, 20, 1], None, 8, [(0, 1), (1, 2), (2, 3)]),
    ([20], None, 8, [(0, 1)]),
    ([0, 0, 0], None, 0, [(0, 3)]),
    ([3, 3, 3, 3], 3, 7, [(0, 2), (2, 4)]),
])
def test_chunks(sizes, max_items, max_bytes, expected):
    got = [(r.start, r.stop) for r in chunks(sizes, max_items=max_items, max_bytes=max_bytes)]
    assert got == expected


def test_map_slices_keeps_order_and_asks_for_threads_only_when_needed():
    asked = []

    def executor():
        asked.append(1)
        return pool

    with ThreadPoolExecutor(3) as pool:
        assert map_slices(lambda x: x * x, range(10), 4, executor) == [x * x for x in range(10)]
        assert len(asked) == 1
        assert map_slices(lambda x: -x, [5], 4, executor) == [-5]
        assert map_slices(lambda x: -x, [1, 2], 1, executor) == [-1, -2]
        assert len(asked) == 1


def test_map_slices_propagates_exceptions():
    def boom(x):
        if x == 7:
            raise OSError("disk")
        return x

    with ThreadPoolExecutor(2) as pool, pytest.raises(OSError, match="disk"):
        map_slices(boom, range(9), 3, lambda: pool)


def test_batched():
    assert list(batched(iter(range(5)), 2)) == [[0, 1], [2, 3], [4]]
    assert list(batched([], 3)) == []
