"""Reading pages from the node tier (the host-memory pool shared by the
instances of a machine, vllm_hicache/node) into a process's own buffers,
against numpy's copy of the same bytes from private memory, the private
L2's path (issue 22's target: the shared tier at >= 80% of its bandwidth).

16 pages of 1 MiB (one 16-layer block of a small model each) per read, in
one ``read_prefix``: one index transaction to pin them, the seal checks and
copies, one to unpin. ``verify_checksum`` adds xxh3 over every page. Each
benchmark records its GB/s, the baseline's and their ratio in
``extra_info``; the baseline is a benchmark too (``test_numpy_copy``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest

from vllm_hicache.node import NodeTier, join

PAGE_BYTES = 1 << 20
PAGES = 16
BASELINE_REPEATS = 7

pytestmark = pytest.mark.benchmark(group="node tier read")


def page_of(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE_BYTES, dtype=np.uint8)


@pytest.fixture(scope="module")
def tier() -> Iterator[NodeTier]:
    root = tempfile.mkdtemp(prefix="hicache-node-bench-",
                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    # Room for the pages plus the segment's headers.
    tier = join("bench", "bench-identity", (PAGES + 2) * PAGE_BYTES, PAGE_BYTES, root=root)
    got = tier.reserve(PAGES)
    for i, res in enumerate(got.slots):
        tier.write(res, page_of(i))
        assert tier.seal(res, b"page-%d" % i)
    yield tier
    tier.leave()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def private() -> np.ndarray:
    return np.stack([page_of(i) for i in range(PAGES)])


def numpy_copy(src: np.ndarray, dst: np.ndarray) -> None:
    np.copyto(dst, src)


@pytest.fixture(scope="module")
def numpy_s(private: np.ndarray) -> float:
    """Median seconds of the baseline, measured once for the ratios."""
    dst = np.empty_like(private)
    times = []
    for _ in range(BASELINE_REPEATS):
        start = time.perf_counter()
        numpy_copy(private, dst)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def test_numpy_copy(benchmark, private: np.ndarray) -> None:
    dst = np.empty_like(private)
    benchmark(numpy_copy, private, dst)
    benchmark.extra_info["gbps"] = private.nbytes / benchmark.stats.stats.median / 1e9
    assert np.array_equal(dst, private)


@pytest.mark.parametrize("verify_checksum", [False, True], ids=["seal", "seal+checksum"])
def test_read_prefix(benchmark, tier: NodeTier, private: np.ndarray, numpy_s: float,
                     verify_checksum: bool) -> None:
    keys = [b"page-%d" % i for i in range(PAGES)]
    outs = np.zeros_like(private)
    rows = list(outs)
    read = benchmark(tier.read_prefix, keys, rows, verify_checksum)
    assert read == PAGES and np.array_equal(outs, private), "a page was not read back"
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(gbps=private.nbytes / seconds / 1e9,
                                numpy_gbps=private.nbytes / numpy_s / 1e9,
                                ratio_to_numpy=numpy_s / seconds)
