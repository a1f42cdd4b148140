"""Prefetch latency while a slow store is busy writing backups.

One worker's L3 client (``StorageIO`` over a ``PageStore``) on the ``file``
backend throttled to ``--write-mb-s`` (benchmarks/throttled_l3.py; reads
unthrottled, page-cache resident). A backlog of backups, one host page
each, is queued; while they are written, prefetches of pages already in L3
are submitted evenly over the backlog's length and timed from submit to
"finished" (the op's own timing: queued + read + checked): what a request
under ``wait_complete`` waits for.

Three rows, the same store, process and pages:
- ``idle``: no backup queued (the baseline);
- ``busy``: the backlog queued first, as the client runs it today (reads on
  threads of their own, l3/worker_io.py);
- ``busy, one FIFO pool``: the same, with reads sent to the write threads'
  queue, as the client ran them before 2026-12-02 (the ratio it avoids).

Ratios of the mean are against ``idle``; the target is <= 1.1 for ``busy``.

Run: .venv/bin/python benchmarks/bench_read_behind_writes.py [--write-mb-s 0.25]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throttled_l3 import ThrottledFileBackend  # noqa: E402

from vllm_hicache.common.jobs import BackupJob, PrefetchJob  # noqa: E402
from vllm_hicache.host import HostKVPool  # noqa: E402
from vllm_hicache.keys import KeyNamespace  # noqa: E402
from vllm_hicache.l3.worker_io import StorageIO  # noqa: E402
from vllm_hicache.storage import StorageContext  # noqa: E402
from vllm_hicache.storage.format import HEADER_BYTES  # noqa: E402
from vllm_hicache.storage.pages import PageStore  # noqa: E402

# 2 layers x 2 planes (K, V) x 32 tokens x 4 heads x 64 dims x float32 = 128 KiB a page.
NUM_LAYERS, PLANES, PAGE_TOKENS, HEADS, HEAD_SIZE = 2, 2, 32, 4, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-mb-s", type=float, default=0.25,
                        help="the store's write bandwidth (MB/s)")
    parser.add_argument("--backups", type=int, default=8, help="backups queued (one page each)")
    parser.add_argument("--reads", type=int, default=5, help="prefetches timed per row")
    parser.add_argument("--read-pages", type=int, default=4, help="pages per prefetch")
    parser.add_argument("--dir", default=None, help="scratch parent directory")
    return parser.parse_args()


def page_store(path: str, write_mb_s: float, num_pages: int) -> PageStore:
    pool = HostKVPool(num_pages, NUM_LAYERS, PLANES, PAGE_TOKENS, HEADS, HEAD_SIZE,
                      torch.float32, "page_first", pin_memory=False)
    pool.buffer.copy_(torch.randn_like(pool.buffer))
    ctx = StorageContext("worker", 0, 1, HEADER_BYTES + pool.bytes_per_page)
    backend = ThrottledFileBackend({"path": path, "write_mb_s": write_mb_s}, ctx)
    return PageStore(backend, pool, KeyNamespace("bench/model", "float32", "page_first",
                                                 PAGE_TOKENS, 1, 0))


def key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def timed_reads(io: StorageIO, args: argparse.Namespace, first_op: int,
                target_page: int, spread_s: float) -> list[float]:
    """Seconds from submit to finished, per prefetch; the prefetches are
    submitted evenly over ``spread_s`` (the backlog's length), each without
    waiting for the one before, as requests arrive."""
    hashes = tuple(key(p) for p in range(args.read_pages))
    pages = tuple(range(target_page, target_page + args.read_pages))
    started = time.perf_counter()
    for i in range(args.reads):
        time.sleep(max(0.0, started + i * spread_s / args.reads - time.perf_counter()))
        io.submit_prefetch(PrefetchJob(first_op + i, hashes, pages))
    for i in range(args.reads):
        assert io.wait_read(first_op + i, args.read_pages, 600.0) == args.read_pages
    timings = io.take_prefetch_timings()
    assert sorted(timings) == [first_op + i for i in range(args.reads)]
    return [sum(t) for t in timings.values()]


def run_row(path: str, args: argparse.Namespace, busy: bool, one_pool: bool,
            first_op: int, spread_s: float) -> list[float]:
    """A fresh client per row (shutdown closes its backend), on the same directory."""
    store = page_store(path, args.write_mb_s, 2 * args.read_pages + args.backups)
    # The pages the prefetches read, in L3 before the row starts: unthrottled.
    store.backend.write_link.bytes_per_s = 0
    assert all(store.write([key(p) for p in range(args.read_pages)],
                           list(range(args.read_pages))))
    store.backend.write_link.bytes_per_s = args.write_mb_s * 1e6
    io = StorageIO(store, worker_id=0, writes=True)
    # One untimed read first: every row starts with warm threads and files.
    io.submit_prefetch(PrefetchJob(first_op - 1, (key(0),), (args.read_pages,)))
    assert io.wait_read(first_op - 1, 1, 600.0) == 1
    io.take_prefetch_timings()
    if one_pool:  # as before 2026-12-02: one FIFO queue for reads and writes
        io._read_pool = io._write_pool
    try:
        if busy:
            base = 1_000 + first_op
            for b in range(args.backups):
                page = args.read_pages + b
                io.submit_backup(BackupJob(first_op + 100 + b, (key(base + b),), (page,)))
        return timed_reads(io, args, first_op, args.read_pages + args.backups, spread_s)
    finally:
        io.wait_idle(600.0)
        io.shutdown()


def main() -> None:
    args = parse_args()
    page_bytes = NUM_LAYERS * PLANES * PAGE_TOKENS * HEADS * HEAD_SIZE * 4
    page_s = page_bytes / (args.write_mb_s * 1e6)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hicache-rbw-") as tmp:
        rows = [("idle", False, False), ("busy", True, False),
                ("busy, one FIFO pool", True, True)]
        results = {}
        for n, (name, busy, one_pool) in enumerate(rows):
            results[name] = run_row(tmp, args, busy, one_pool, 10_000 * (n + 1),
                                    spread_s=args.backups * page_s)
        base = statistics.mean(results["idle"])
        print(f"# {shlex.join(sys.argv)}")
        print(f"# store writes {args.write_mb_s} MB/s: {page_s:.2f} s a page; "
              f"{args.backups} one-page backups queued; prefetches of {args.read_pages} pages")
        print(f"| {'row':<22} | {'mean ms':>9} | {'max ms':>8} | {'x idle':>6} |")
        print(f"| {'-' * 22} | {'-' * 8}: | {'-' * 7}: | {'-' * 5}: |")
        for name, seconds in results.items():
            med = statistics.mean(seconds)
            print(f"| {name:<22} | {med * 1e3:>9.1f} | {max(seconds) * 1e3:>8.1f} | "
                  f"{med / base:>6.2f} |")


if __name__ == "__main__":
    main()
