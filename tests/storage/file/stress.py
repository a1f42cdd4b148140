"""One side of test_backend.py's two-process stress: ``python -m
tests.storage.file.stress SPEC WRITER ITERATIONS``.

Each iteration writes 2 of 8 shared keys, then reads all 8 back. Every
value names its own version in its first 8 bytes and is otherwise a pure
function of (key, version), so any hit can be checked byte for byte even
though the other process overwrites (and, with max_bytes, evicts) the same
keys meanwhile. Objects span several pages, so a non-atomic store is caught
mid-write (a read mixing two versions' pages). Prints ``ok <hits>``.
"""

from __future__ import annotations

import ast
import sys
import time

import numpy as np

from tests.storage.conformance import make

OBJECT_BYTES = 64 + (16 << 10)
NUM_KEYS = 8
# Bound on one side's run, whatever the iteration count.
MAX_SECONDS = 20.0
_INDEX = np.arange(OBJECT_BYTES, dtype=np.uint32)


def value(k: int, version: int) -> list[np.ndarray]:
    """Every byte depends on (k, version): two versions differ all along."""
    data = (_INDEX * (2 * version + 1) + k * 7919 + version).astype(np.uint8)
    data[:8] = np.frombuffer(np.int64(version).tobytes(), np.uint8)
    return [data[:64], data[64:]]


def main(spec: tuple, writer: int, iterations: int) -> int:
    backend = make(spec)
    rng = np.random.default_rng(writer)
    hits, deadline = 0, time.monotonic() + MAX_SECONDS
    for i in range(iterations):
        if time.monotonic() > deadline:
            break
        written = sorted({int(k) for k in rng.integers(0, NUM_KEYS, 2)})
        backend.put([f"hc1-stress-{k:02d}" for k in written],
                    [value(k, writer * 10**6 + i) for k in written])
        ks = range(NUM_KEYS)
        names = [f"hc1-stress-{k:02d}" for k in ks]
        targets = [[np.zeros(64, np.uint8), np.zeros(OBJECT_BYTES - 64, np.uint8)] for _ in ks]
        for k, got, ok in zip(ks, targets, backend.get(names, targets)):
            if ok:
                version = int(np.frombuffer(got[0][:8].tobytes(), np.int64)[0])
                want = value(k, version)
                assert all(np.array_equal(x, y) for x, y in zip(got, want)), (k, version)
                hits += 1
    backend.close()
    return hits


if __name__ == "__main__":
    print("ok", main(ast.literal_eval(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
