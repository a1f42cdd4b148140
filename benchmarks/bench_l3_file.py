"""``file`` L3 backend throughput vs raw system calls on the same bytes.

For each object size (host-page-sized payloads plus the 64-byte header), a
batch of objects is written with ``FileBackend.put`` and read back with
``FileBackend.get`` (one batch per sample), and the same bytes are written
and read by the raw engine in the same run: one file per object in the same
scratch directory, ``os.open`` + ``os.writev`` (+ ``os.fsync`` when the case
says so) + ``close``, and ``os.open`` + ``os.preadv`` + ``close``, on one
thread.

Rows:
- write: ``new`` cases empty both stores before each round (untimed), so
  every object is a new file; ``overwrite`` rewrites the same keys.
- read (cache): the files were just written, so reads come from the page
  cache; this exposes the per-object overhead (key check, path, probe byte).
- read (cold): page cache dropped before each sample (root only; skipped
  otherwise) — the usual L3 read, where ``num_io_threads`` pays off.
Samples alternate raw and backend, every write starts after an untimed
``os.sync()`` (no dirty pages left behind by the other engine), and the
median sample is reported. Ratio = backend MB/s / raw MB/s; target >= 80%.

Run: .venv/bin/python benchmarks/bench_l3_file.py [--rounds 5] [--dir DIR] [--threads 4]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402

HEADER = 64
# (objects, payload bytes): 256 x 1 MiB and 1024 x 64 KiB pages.
SHAPES = ((256, 1 << 20), (1024, 64 << 10))
DROP_CACHES = "/proc/sys/vm/drop_caches"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fsync-rounds", type=int, default=3)
    parser.add_argument("--cold-rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch parent directory (default: $TMPDIR)")
    parser.add_argument("--threads", type=int, default=4, help="backend num_io_threads")
    return parser.parse_args()


def make_objects(n: int, payload: int) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    """Sources with random bytes, and zeroed targets; both pre-faulted (first
    touch costs 0.3-0.8 GB/s on these VMs and would dominate round one)."""
    pool = np.random.default_rng(0).integers(0, 256, n * (HEADER + payload), dtype=np.uint8)
    dest = np.ones(pool.nbytes, np.uint8)

    def split(buf: np.ndarray) -> list[list[np.ndarray]]:
        step = HEADER + payload
        return [[buf[i * step:i * step + HEADER], buf[i * step + HEADER:(i + 1) * step]]
                for i in range(n)]

    return split(pool), split(dest)


def raw_write(directory: str, sources: list[list[np.ndarray]], fsync: bool) -> None:
    for i, bufs in enumerate(sources):
        fd = os.open(f"{directory}/raw-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.writev(fd, bufs)
        if fsync:
            os.fsync(fd)
        os.close(fd)


def raw_read(directory: str, targets: list[list[np.ndarray]]) -> None:
    for i, bufs in enumerate(targets):
        fd = os.open(f"{directory}/raw-{i}", os.O_RDONLY)
        os.preadv(fd, bufs, 0)
        os.close(fd)


def clear_raw(directory: str, n: int) -> None:
    for i in range(n):
        try:
            os.unlink(f"{directory}/raw-{i}")
        except FileNotFoundError:
            pass


def can_drop_caches() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("1")


def timed(before, fn, *args) -> float:
    """Seconds of ``fn(*args)``, after the untimed ``before()``."""
    before()
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class Pair:
    """The raw engine and the backend on the same objects."""

    def __init__(self, scratch: str, shape: tuple[int, int], options: dict, threads: int):
        self.n, payload = shape
        self.sources, self.targets = make_objects(self.n, payload)
        self.raw_dir = os.path.join(scratch, "raw")
        os.makedirs(self.raw_dir, exist_ok=True)
        ctx = StorageContext("worker", 0, 1, HEADER + payload)
        self.backend = create_backend("file", {"path": os.path.join(scratch, "l3"),
                                               "num_io_threads": threads, **options}, ctx)
        self.keys = [f"hc1-bench-{payload}-{i:06d}" for i in range(self.n)]
        self.fsync = options.get("fsync", False)

    def write(self, fresh: bool) -> tuple[float, float]:
        if fresh:
            clear_raw(self.raw_dir, self.n)
            self.backend.clear()
        return (timed(os.sync, raw_write, self.raw_dir, self.sources, self.fsync),
                timed(os.sync, self.backend.put, self.keys, self.sources))

    def read(self, before) -> tuple[float, float]:
        return (timed(before, raw_read, self.raw_dir, self.targets),
                timed(before, self.backend.get, self.keys, self.targets))

    def check_and_close(self) -> None:
        try:
            for target in self.targets:  # the raw engine filled them too
                target[1][:] = 0
            assert self.backend.get(self.keys, self.targets) == [True] * self.n
            assert all(np.array_equal(t[1], s[1]) for t, s in zip(self.targets, self.sources))
        finally:
            self.backend.clear()
            self.backend.close()
            shutil.rmtree(self.raw_dir, ignore_errors=True)


def measure(pair: Pair, rounds: int, fresh: bool, cold_rounds: int) -> dict[str, list]:
    """op -> [(raw s, backend s), ...] samples."""
    samples: dict[str, list] = {"write": [], "read (cache)": [], "read (cold)": []}
    for _ in range(rounds):
        samples["write"].append(pair.write(fresh))
        samples["read (cache)"].append(pair.read(os.sync))
    for _ in range(cold_rounds):
        samples["read (cold)"].append(pair.read(drop_caches))
    return {op: s for op, s in samples.items() if s}


def main() -> None:
    args = parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    scratch = tempfile.mkdtemp(prefix="bench_l3_file-", dir=args.dir)
    cold = args.cold_rounds if can_drop_caches() else 0
    print(f"scratch: {scratch} ({fs_type(scratch)}); backend num_io_threads={args.threads}; "
          f"CPUs: {os.cpu_count()}; cold reads: {'yes' if cold else 'no (needs root)'}")
    # (label, backend options, rounds, fresh files every round, cold-read rounds)
    cases = [("new", {}, args.rounds, True, cold),
             ("overwrite", {}, args.rounds, False, 0),
             ("new max_bytes", {"max_bytes": 8 << 30}, args.rounds, True, 0),
             ("new fsync", {"fsync": True}, args.fsync_rounds, True, 0)]
    header = (f"{'case':<14} {'objects':>13} {'op':<12} {'raw MB/s':>9} {'file MB/s':>10} "
              f"{'ratio':>6}")
    print(header + "\n" + "-" * len(header))
    try:
        for label, options, rounds, fresh, cold_rounds in cases:
            for n, payload in SHAPES:
                pair = Pair(scratch, (n, payload), options, args.threads)
                try:
                    samples = measure(pair, rounds, fresh, cold_rounds)
                finally:
                    pair.check_and_close()
                mb = n * (HEADER + payload) / 1e6
                for op, pairs in samples.items():
                    raw, ours = (statistics.median(s) for s in zip(*pairs))
                    print(f"{label:<14} {f'{n} x {payload >> 10} KiB':>13} {op:<12} "
                          f"{mb / raw:>9.0f} {mb / ours:>10.0f} {raw / ours:>6.0%}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (Linux), or "?"."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                _, mount, fstype, *_ = line.split()
                if path.startswith(mount) and len(mount) > len(best):
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


if __name__ == "__main__":
    main()
