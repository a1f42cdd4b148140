"""Buffers helpers: gather then scatter is the identity, whatever the split."""

from __future__ import annotations

import numpy as np

from vllm_hicache.storage.buffers import address, gather, scatter, total_bytes


def test_gather_scatter_round_trip():
    rng = np.random.default_rng(0)
    source = [rng.integers(0, 256, n, dtype=np.uint8) for n in (64, 0, 4096, 7)]
    flat = np.zeros(total_bytes(source) + 5, np.uint8)
    assert gather(source, flat) == 64 + 4096 + 7 == total_bytes(source)
    target = [np.zeros_like(b) for b in source]
    scatter(flat, target)
    assert all(np.array_equal(a, b) for a, b in zip(source, target))
    assert address(flat[16:]) == address(flat) + 16 == flat.ctypes.data + 16
