"""L1 <-> L2 copies (``KVTransfer.store`` / ``load``) per host memory layout,
with numpy's memcpy of the same bytes as the baseline, in the same module.

Set-up is benchmarks/bench_copy.py's (vLLM's CPU_ATTN allocation of L1, a
pool per layout, contiguous and scattered block ids), with Llama-3-8B's
layers and heads but blocks of 16 tokens (2 MiB) and 16 of them instead of
bench_copy.py's 256 blocks of 32 tokens: 32 MiB per copy, so that the 12
copies of a CPU machine take seconds, not minutes.
Each copy benchmark records in ``extra_info`` its GB/s, the baseline's and
their ratio (bench_copy.py's target: >= 80%). The baseline itself is a
benchmark too (``test_numpy_copyto``), so a slower machine shows there.

``io_backend=kernel`` needs CUDA, Triton and a pinned pool; without them its
benchmarks are skipped, saying which is missing.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from bench_copy import (
    build_l1,
    build_pool,
    copy_call,
    describe_layers,
    id_patterns,
    io_backend_missing,
    numpy_baseline,
)

from vllm_hicache.host import MEM_LAYOUTS
from vllm_hicache.kernels import make_transfer

GEOMETRY = argparse.Namespace(layers=32, heads=8, head_size=128, block_size=16, blocks=16, seed=0)
BASELINE_REPEATS = 7

pytestmark = pytest.mark.benchmark(group="copy L1<->L2")


class L1:
    """vLLM's KV tensors for GEOMETRY on this machine's device."""

    def __init__(self) -> None:
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.raw, self.layers = build_l1(GEOMETRY, self.device)
        self.layouts = describe_layers(GEOMETRY, self.layers, self.device)
        self.nbytes = self.raw.numel() * self.raw.element_size()
        self.patterns = id_patterns(GEOMETRY.blocks, GEOMETRY.seed)


@pytest.fixture(scope="module")
def l1() -> L1:
    return L1()


@pytest.fixture(scope="module")
def numpy_s(l1: L1) -> float:
    """Median seconds of np.copyto of the L1 bytes, measured once for the ratios."""
    pool = build_pool(GEOMETRY, MEM_LAYOUTS[0], l1.layouts)
    return numpy_baseline(l1.raw.cpu(), pool, BASELINE_REPEATS)


def bits_sum(t: torch.Tensor) -> int:
    """Sum of the bytes as int16: equal before and after a copy of every block."""
    return int(t.view(torch.int16).sum(dtype=torch.int64))


def test_numpy_copyto(benchmark, l1: L1) -> None:
    host = l1.raw.cpu()
    pool = build_pool(GEOMETRY, MEM_LAYOUTS[0], l1.layouts)
    src = host.view(torch.int16).view(-1).numpy()
    dst = pool.buffer.view(torch.int16).view(-1).numpy()
    benchmark(np.copyto, dst, src)
    benchmark.extra_info["gbps"] = l1.nbytes / benchmark.stats.stats.median / 1e9
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("ids", ["contiguous", "scattered"])
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_copy(benchmark, l1: L1, numpy_s: float, mem_layout: str, io_backend: str, ids: str,
              direction: str) -> None:
    pool = build_pool(GEOMETRY, mem_layout, l1.layouts)
    missing = io_backend == "kernel" and io_backend_missing(l1.device, pool)
    if missing:
        pytest.skip(f"io_backend=kernel needs {missing}")
    transfer = make_transfer(io_backend, l1.layers, l1.layouts, pool)
    blocks, pages = l1.patterns[ids]
    # Every block gets a page, so a complete copy keeps the sum of the bits;
    # the store also gives a load real data to bring back (L1 stays as it was).
    l1_sum = bits_sum(l1.raw)
    pool.buffer.zero_()
    copy_call(transfer, "store", blocks, pages)()
    assert bits_sum(pool.buffer) == l1_sum, "the store left blocks out"
    benchmark(copy_call(transfer, direction, blocks, pages))
    assert bits_sum(l1.raw) == l1_sum, "the load changed L1"
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(
        gbps=l1.nbytes / seconds / 1e9, numpy_gbps=l1.nbytes / numpy_s / 1e9,
        ratio_to_numpy=numpy_s / seconds)
