"""merge_runs: positional (block, page) pairs -> maximal runs."""

from __future__ import annotations

import pytest

from vllm_hicache.kernels.plan import Run, merge_runs


@pytest.mark.parametrize(
    "blocks,pages,expected",
    [
        ([], [], []),
        ([7], [3], [Run(7, 3, 1)]),
        ([1, 2, 3], [5, 6, 7], [Run(1, 5, 3)]),
        # Blocks step by one but pages do not: the run breaks.
        ([1, 2, 3], [5, 6, 9], [Run(1, 5, 2), Run(3, 9, 1)]),
        ([4, 5, 0, 1, 9], [0, 1, 2, 3, 4], [Run(4, 0, 2), Run(0, 2, 2), Run(9, 4, 1)]),
        # Descending ids never merge.
        ([3, 2, 1], [3, 2, 1], [Run(3, 3, 1), Run(2, 2, 1), Run(1, 1, 1)]),
    ],
)
def test_merge_runs(blocks, pages, expected):
    assert merge_runs(blocks, pages) == expected
    assert sum(run.length for run in expected) == len(blocks)
