"""CPU time per object of the ``file`` L3's put path, fresh and warm store.

A no-reuse request's backups are puts of new objects: each object a new
file, most of them in a fan-out directory not made yet while the store is
young. This writes ``--objects`` objects of ``--object-bytes`` (64-byte
header + payload, as the connector stores them) in batches of ``--batch``
(one request's backup job) and reports the process's CPU time per object
(``time.process_time``: every thread, the I/O pool's too), so it stays
meaningful on a shared machine where wall time does not. Cases:

- fresh: an empty store directory; each run starts in a new one.
- warm: all 65,536 ``aa/bb`` directories exist (a store in service), made
  untimed before the run.

Runs alternate the cases; the median of ``--rounds`` is reported, with the
range. ``--profile`` prints a cProfile (CPU clock) of one fresh run on one
I/O thread; ``strace -c -f`` on this script gives the system calls.

    .venv/bin/python benchmarks/bench_file_put_cpu.py [--objects 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402

HEADER_BYTES = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objects", type=int, default=2048)
    p.add_argument("--object-bytes", type=int, default=16 << 10, help="payload per object")
    p.add_argument("--batch", type=int, default=28, help="objects per put (one backup job)")
    p.add_argument("--threads", type=int, default=4, help="num_io_threads")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="scratch parent (default: $TMPDIR)")
    p.add_argument("--cases", default="fresh,warm")
    p.add_argument("--warm-dir", default=None,
                   help="keep the warm store here between invocations (made if missing)")
    p.add_argument("--profile", action="store_true")
    return p.parse_args()


def make_fanout(path: str) -> None:
    for top in range(256):
        for leaf in range(256):
            os.makedirs(os.path.join(path, f"{top:02x}", f"{leaf:02x}"), mode=0o700,
                        exist_ok=True)


def run_once(store: str, args: argparse.Namespace, salt: str, threads: int) -> float:
    """CPU seconds per object to put ``args.objects`` new objects into ``store``."""
    backend = create_backend("file", {"path": store, "num_io_threads": threads},
                             StorageContext("worker", 0, 1, HEADER_BYTES + args.object_bytes))
    try:
        header = np.zeros(HEADER_BYTES, np.uint8)
        payload = np.ones(args.object_bytes, np.uint8)
        keys = [f"bench-{salt}-{i:08d}" for i in range(args.objects)]
        backend.put(["warmup-pool"], [[header, payload]])  # starts the pool, untimed
        start = time.process_time()
        for at in range(0, len(keys), args.batch):
            chunk = keys[at:at + args.batch]
            stored = backend.put(chunk, [[header, payload]] * len(chunk))
            assert all(stored), "a put failed"
        return (time.process_time() - start) / len(keys)
    finally:
        backend.close()


def main() -> None:
    args = parse_args()
    parent = tempfile.mkdtemp(prefix="hicache-putcpu-", dir=args.dir)
    cases = args.cases.split(",")
    try:
        warm = args.warm_dir or os.path.join(parent, "warm")
        if "warm" in cases and not os.path.isdir(os.path.join(warm, "ff", "ff")):
            make_fanout(warm)
        if args.profile:
            prof = cProfile.Profile(time.process_time)
            prof.enable()
            run_once(os.path.join(parent, "profiled"), args, "profile", 1)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        results: dict[str, list[float]] = {c: [] for c in cases}
        for r in range(args.rounds):
            for case in cases:
                if case == "fresh":
                    store = os.path.join(parent, f"fresh{r}")
                    results[case].append(run_once(store, args, f"r{r}", args.threads))
                    shutil.rmtree(store)
                else:
                    results[case].append(run_once(warm, args, f"{os.getpid()}-r{r}", args.threads))
        print(f"{args.objects} objects of {HEADER_BYTES}+{args.object_bytes} B, batches of "
              f"{args.batch}, {args.threads} I/O threads, {args.rounds} rounds, in {parent}")
        for case, values in results.items():
            us = [v * 1e6 for v in values]
            print(f"{case:6s} CPU us/object: median {statistics.median(us):7.1f}  "
                  f"[{min(us):.1f}-{max(us):.1f}]")
    finally:
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
