"""L3 throughput of the mooncake backend vs the raw Mooncake engine, same bytes.

Starts a private mooncake_master + mooncake_client storage daemon (127.0.0.1,
free ports, P2PHANDSHAKE, TCP), then, for each object size, measures
interleaved repeat by repeat, each with fresh keys (a put of an existing key
is a no-op in Mooncake), removing them afterwards:

- raw: ``batch_put_from`` / ``batch_get_into`` of each object as one
  contiguous (64 B header + payload) run of a registered numpy buffer;
- raw-mb: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``
  with the header and payload as two runs of a registered buffer;
- ours: ``MooncakeBackend.put`` / ``get`` as the connector calls them: header
  and payload are copied through the backend's registered staging area (the
  host pool is never registered with Mooncake's transfer engine: docs/security.md).

Ratios: ours / raw (the target is >= 80%) and ours / raw-mb (the same
two-slice transfer, so what our own code costs). MB/s are 1e6 B/s of whole objects,
the median of the repeats, after one unmeasured warm-up round (first-touch
page faults of the daemon's segment are slow on small VMs).

Run (Mooncake listens on all interfaces too: use a private netns, as root):
  unshare -n sh -c 'ip link set lo up && .venv/bin/python benchmarks/bench_l3_mooncake.py'
  [--repeats 5] [--cases 256x1048576,1024x65536] [--batch 0 (= all keys per call)]
Bounded: each case moves its bytes 6 x (repeats + 1) times; ~20 s with the defaults.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.storage.mooncake.services import MooncakeServices  # noqa: E402
from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402

HEADER = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default="256x1048576,1024x65536",
                        help="comma-separated COUNTxPAYLOAD_BYTES")
    parser.add_argument("--batch", type=int, default=0, help="keys per call (0: all)")
    parser.add_argument("--segment", default="2GB", help="the daemon's memory")
    return parser.parse_args()


class Case:
    """``count`` objects of HEADER + ``payload`` bytes, three ways laid out."""

    def __init__(self, count: int, payload: int) -> None:
        self.count, self.payload, self.size = count, payload, HEADER + payload
        rng = np.random.default_rng(count * payload)
        # raw: objects back to back; raw-mb and ours: headers apart, pages in a pool.
        self.raw = rng.integers(0, 256, count * self.size, dtype=np.uint8)
        self.raw_back = np.zeros_like(self.raw)
        self.pool = np.zeros(2 * count * payload, np.uint8)
        self.headers = np.zeros(2 * count * HEADER, np.uint8)
        for i in range(count):
            obj = self.raw[i * self.size:(i + 1) * self.size]
            self.headers[i * HEADER:(i + 1) * HEADER] = obj[:HEADER]
            self.pool[i * payload:(i + 1) * payload] = obj[HEADER:]

    def page(self, slot: int) -> np.ndarray:
        return self.pool[slot * self.payload:(slot + 1) * self.payload]

    def header(self, slot: int) -> np.ndarray:
        return self.headers[slot * HEADER:(slot + 1) * HEADER]

    @property
    def total(self) -> int:
        return self.count * self.size


def batches(n: int, batch: int) -> list[slice]:
    step = batch or n
    return [slice(lo, min(n, lo + step)) for lo in range(0, n, step)]


def run_raw(store, case: Case, keys: list[str], batch: int) -> tuple[float, float]:
    put_ptrs = [case.raw.ctypes.data + i * case.size for i in range(case.count)]
    get_ptrs = [case.raw_back.ctypes.data + i * case.size for i in range(case.count)]
    sizes = [case.size] * case.count
    t0 = time.perf_counter()
    for s in batches(case.count, batch):
        assert store.batch_put_from(keys[s], put_ptrs[s], sizes[s]) == [0] * len(keys[s])
    t1 = time.perf_counter()
    for s in batches(case.count, batch):
        assert store.batch_get_into(keys[s], get_ptrs[s], sizes[s]) == sizes[s]
    t2 = time.perf_counter()
    assert np.array_equal(case.raw, case.raw_back)
    case.raw_back[:] = 0
    return t1 - t0, t2 - t1


def run_raw_mb(store, case: Case, keys: list[str], batch: int) -> tuple[float, float]:
    def ptrs(first: int) -> list[list[int]]:
        return [[case.header(first + i).ctypes.data, case.page(first + i).ctypes.data]
                for i in range(case.count)]

    sizes = [[HEADER, case.payload]] * case.count
    put_ptrs, get_ptrs = ptrs(0), ptrs(case.count)
    t0 = time.perf_counter()
    for s in batches(case.count, batch):
        assert store.batch_put_from_multi_buffers(keys[s], put_ptrs[s], sizes[s]) == [0] * len(
            keys[s])
    t1 = time.perf_counter()
    for s in batches(case.count, batch):
        got = store.batch_get_into_multi_buffers(keys[s], get_ptrs[s], sizes[s])
        assert got == [case.size] * len(keys[s])
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def run_ours(backend, case: Case, keys: list[str], batch: int) -> tuple[float, float]:
    # As storage/pages.py calls it: fresh header arrays, payloads in the pool.
    sources = [[case.header(i).copy(), case.page(i)] for i in range(case.count)]
    targets = [[np.empty(HEADER, np.uint8), case.page(case.count + i)]
               for i in range(case.count)]
    t0 = time.perf_counter()
    for s in batches(case.count, batch):
        assert all(backend.put(keys[s], sources[s]))
    t1 = time.perf_counter()
    for s in batches(case.count, batch):
        assert all(backend.get(keys[s], targets[s]))
    t2 = time.perf_counter()
    assert all(np.array_equal(t[1], s[1]) and np.array_equal(t[0], s[0])
               for t, s in zip(targets, sources))
    return t1 - t0, t2 - t1


def measure(store, backend, case: Case, args) -> dict[str, list[tuple[float, float]]]:
    backend.register_memory(case.pool)
    buffers = (case.raw, case.raw_back, case.pool, case.headers)
    for buf in buffers:
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    try:
        return _repeat(store, backend, case, args)
    finally:
        for buf in buffers:
            store.unregister_buffer(buf.ctypes.data)


def _repeat(store, backend, case: Case, args) -> dict[str, list[tuple[float, float]]]:
    runs = {"raw": run_raw, "raw-mb": run_raw_mb, "ours": run_ours}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for rep in range(args.repeats + 1):
        for name, fn in runs.items():
            tag = uuid.uuid4().hex[:8]
            keys = [f"hc1-bench-{tag}-{i}" for i in range(case.count)]
            elapsed = fn(backend if name == "ours" else store, case, keys, args.batch)
            if rep:  # rep 0 warms the daemon's segment up
                times[name].append(elapsed)
            store.batch_remove(keys, True)
    return times


def main() -> None:
    args = parse_args()
    cases = [Case(*map(int, c.split("x"))) for c in args.cases.split(",")]
    from mooncake.store import MooncakeDistributedStore

    with tempfile.TemporaryDirectory() as tmp:
        services = MooncakeServices(Path(tmp), segment=args.segment).start()
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "",
                           services.address) == 0
        rows = []
        try:
            for case in cases:
                backend = create_backend("mooncake", {"master_server_address": services.address},
                                         StorageContext("worker", 0, 1, case.size))
                try:
                    rows.append((case, measure(store, backend, case, args)))
                finally:
                    backend.close()
        finally:
            store.close()
            services.stop()
    report(rows, args)


def report(rows, args) -> None:
    print(f"mooncake L3: TCP loopback, pure clients -> 1 storage daemon; median of "
          f"{args.repeats}; batch {'all' if not args.batch else args.batch} keys/call; MB/s")
    print(f"{'objects':>16} {'op':>4} {'raw':>8} {'raw-mb':>8} {'ours':>8} {'ours/raw':>9} "
          f"{'ours/raw-mb':>12}")
    for case, times in rows:
        for op, idx in (("put", 0), ("get", 1)):
            mbs = {name: case.total / statistics.median(t[idx] for t in ts) / 1e6
                   for name, ts in times.items()}
            label = f"{case.count} x {case.payload // 1024} KiB"
            print(f"{label:>16} {op:>4} {mbs['raw']:8.0f} {mbs['raw-mb']:8.0f} "
                  f"{mbs['ours']:8.0f} {mbs['ours'] / mbs['raw']:9.0%} "
                  f"{mbs['ours'] / mbs['raw-mb']:12.0%}")


if __name__ == "__main__":
    main()
