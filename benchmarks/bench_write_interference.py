"""Does an L3's write pattern slow the compute core? A matmul loop (torch, one
thread) on one core while a writer thread on the other core writes 96 KiB
objects at a fixed rate, as the file backend's backups do at high load
(about 8 MB/s in ``bench_serve_ab.py``'s random-high):

    none      no writer: the baseline, measured in the same run
    files     one file per object, written to a temp name and renamed into
              two fan-out levels of directories (the file backend's pattern)
    packed    the same bytes appended to one file with ``pwrite``: what a
              packed format (many objects per file) would leave the file
              system to do

each against every directory given (e.g. this VM's ext4 disk and a tmpfs).
Variants rotate within each repetition; reported: loop iterations per
second, and the ratio to ``none`` (mean over repetitions). Each run starts
after ``os.sync()`` and a pause, and lasts ``--seconds``: past 30 s the
kernel's writeback of the dirty pages (``dirty_expire_centisecs``) runs
during the measurement too.

Run: .venv/bin/python benchmarks/bench_write_interference.py \\
         --dirs /work/wi,/dev/shm/wi [--rate-mb 8] [--seconds 50] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
import zlib

import torch

OBJECT_BYTES = 96 * 1024
PACK_BYTES = 512 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dirs", required=True, help="comma-separated scratch directories")
    p.add_argument("--rate-mb", type=float, default=8.0, help="MB/s the writer writes")
    p.add_argument("--seconds", type=float, default=50.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--compute-core", type=int, default=0)
    p.add_argument("--writer-core", type=int, default=1)
    return p.parse_args()


def write_file(root: str, key: str, payload: bytes) -> None:
    h = zlib.crc32(key.encode())
    leaf = f"{root}/{h >> 8 & 0xFF:02x}/{h & 0xFF:02x}"
    os.makedirs(leaf, exist_ok=True)
    tmp = f"{leaf}/.{key}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, payload)
    finally:
        os.close(fd)
    os.rename(tmp, f"{leaf}/{key}.hckv")


def writer(kind: str, root: str, rate: float, core: int, stop: threading.Event) -> None:
    os.sched_setaffinity(0, {core})
    payload = os.urandom(OBJECT_BYTES)
    pack = os.open(f"{root}/pack", os.O_RDWR | os.O_CREAT, 0o600) if kind == "packed" else -1
    started, n = time.monotonic(), 0
    try:
        while not stop.is_set():
            ahead = started + n * OBJECT_BYTES / rate - time.monotonic()
            if ahead > 0:
                time.sleep(min(ahead, 0.1))
                continue
            if kind == "files":
                write_file(root, f"k{n:09d}", payload)
            else:
                os.pwrite(pack, payload, n * OBJECT_BYTES % PACK_BYTES)
            n += 1
    finally:
        if pack >= 0:
            os.close(pack)


def measure(kind: str, root: str | None, args: argparse.Namespace) -> float:
    """Matmul iterations per second on the compute core while ``kind`` writes."""
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    os.sync()
    time.sleep(2)
    os.sched_setaffinity(0, {args.compute_core})
    a, b = torch.randn(64, 2048), torch.randn(2048, 2048)
    for _ in range(20):
        a @ b
    stop = threading.Event()
    thread = None
    if root is not None:
        thread = threading.Thread(target=writer, args=(kind, root, args.rate_mb * 1e6,
                                                       args.writer_core, stop))
        thread.start()
    started, iterations = time.monotonic(), 0
    try:
        while time.monotonic() - started < args.seconds:
            a @ b
            iterations += 1
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    return iterations / (time.monotonic() - started)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    variants: list[tuple[str, str | None]] = [("none", None)]
    for where in args.dirs.split(","):
        variants += [("files", where), ("packed", where)]
    results: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for kind, root in variants:
            name = kind if root is None else f"{kind}@{root}"
            rate = measure(kind, root, args)
            results.setdefault(name, []).append(rate)
            print(f"#{rep} {name:32s} {rate:7.1f} it/s", flush=True)
    base = sum(results["none"]) / len(results["none"])
    print(f"\n{args.rate_mb:g} MB/s of {OBJECT_BYTES // 1024} KiB objects, {args.seconds:g} s runs")
    for name, rates in results.items():
        mean = sum(rates) / len(rates)
        print(f"{name:32s} {mean:7.1f} it/s  {mean / base:.3f} of none  runs "
              f"{[round(r, 1) for r in rates]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
