"""What an L3 hit's layered read costs the forward it overlaps, through the GIL.

A same-step L3 hit is read on an L3 thread (``PageStore.read_by_layer``) on
the I/O core while the worker's main thread runs the step's forward on the
compute core. Different cores, but one interpreter lock: between its system
calls the reader runs Python (per object: open, header check, ranges,
checksums), and each time the main thread comes back from a torch op while
the reader holds the lock it blocks until the lock is handed over, a
cross-core wake-up (slow in a VM). The reverse holds as well: the read is
slower beside a forward than alone.

Measured here in one process, the way the worker runs it: the "forward" is
a loop of small torch ops on one core (``--layers`` x ``--ops`` matmuls of
``--rows`` x 512 by 512 x 512, fp32, one thread), the read is the demo
model's layer-first document hit (``--pages`` pages of 96 KiB, file backend,
page-cache resident) on another core; each iteration starts one read as the
forward starts, and the forward's layer i waits until the read delivered
layer i, as a same-step hit's copy does. Reported, per
``sys.setswitchinterval`` value: the forward's median time with the read
against the forward alone and against the forward alone plus its wait for
layer 0 alone (the least the read can cost it: nothing overlaps before
layer 0), the read's time against alone (same process, same cores,
interleaved), and the main thread's voluntary context switches per forward
(its lock and layer waits: none alone).

Run: .venv/bin/python benchmarks/bench_read_beside_forward.py [--iterations 40]
     [--dir DIR] [--pages 48] [--layers 6] [--ops 40] [--rows 64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_l3_read_layouts import DIM, HEAD_MAJOR, HEADS, LAYERS, PLANES, TOKENS  # noqa: E402

from vllm_hicache.host import HostKVPool  # noqa: E402
from vllm_hicache.keys import KeyNamespace  # noqa: E402
from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402
from vllm_hicache.storage.pages import PageStore  # noqa: E402

SWITCH_INTERVALS_S = (0.005, 0.0005)  # CPython's default, and a tenth of it
WIDTH = 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="scratch parent directory (default: $TMPDIR)")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--pages", type=int, default=48, help="pages per read (one hit)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--ops", type=int, default=40, help="matmuls per layer")
    p.add_argument("--rows", type=int, default=64, help="rows of each matmul's input")
    return p.parse_args()


class Pair(NamedTuple):
    forward_s: float       # median seconds of one forward
    read_s: float          # median seconds of one read (0: none ran)
    waits: float           # main thread's voluntary context switches per forward


def voluntary_switches() -> int:
    """The calling thread's voluntary context switches so far (Linux)."""
    status = Path(f"/proc/self/task/{threading.get_native_id()}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


class Reader(threading.Thread):
    """Reads the hit once per ``go``, on ``core``; ``done`` when it has.
    ``wait_layer(i)`` blocks until the current read delivered layer i."""

    def __init__(self, store: PageStore, hashes: list[bytes], targets: list[int],
                 core: int) -> None:
        super().__init__(daemon=True, name="bench-reader")
        self.store, self.hashes, self.targets, self.core = store, hashes, targets, core
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.seconds: list[float] = []
        self.first_layer_s: list[float] = []
        self.pages_read = 0
        self._delivered = -1
        self._changed = threading.Condition()

    def run(self) -> None:
        os.sched_setaffinity(0, {self.core})
        while True:
            self.go.acquire()
            started = time.perf_counter()
            self.pages_read = self.store.read_by_layer(
                self.hashes, self.targets, lambda layer, n: self._deliver(layer, started))
            self.seconds.append(time.perf_counter() - started)
            self.done.release()

    def _deliver(self, layer: int, started: float) -> None:
        if layer == 0:
            self.first_layer_s.append(time.perf_counter() - started)
        with self._changed:
            self._delivered = layer
            self._changed.notify_all()

    def start_read(self) -> None:
        with self._changed:
            self._delivered = -1
        self.go.release()

    def wait_layer(self, layer: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._delivered >= layer, timeout=10)


def forward(x: torch.Tensor, weight: torch.Tensor, layers: int, ops: int,
            reader: Reader | None = None) -> torch.Tensor:
    for layer in range(layers):
        if reader is not None:
            reader.wait_layer(min(layer, LAYERS - 1))
        for _ in range(ops):
            x = torch.tanh(x @ weight) * 0.5
    return x


def measure(reader: Reader, args: argparse.Namespace, with_read: bool) -> Pair:
    x, weight = torch.randn(args.rows, WIDTH), torch.randn(WIDTH, WIDTH)
    forward(x, weight, args.layers, args.ops)  # warm
    seconds, first_read = [], len(reader.seconds)
    waits_before = voluntary_switches()
    for _ in range(args.iterations):
        if with_read:
            reader.start_read()
        started = time.perf_counter()
        forward(x, weight, args.layers, args.ops, reader if with_read else None)
        seconds.append(time.perf_counter() - started)
        if with_read:
            reader.done.acquire()
            if reader.pages_read != args.pages:
                raise SystemExit(f"read {reader.pages_read} of {args.pages} pages")
    waits = (voluntary_switches() - waits_before) / args.iterations
    reads = reader.seconds[first_read:]
    return Pair(statistics.median(seconds), statistics.median(reads) if reads else 0.0, waits)


class ReadAlone(NamedTuple):
    read_s: float          # median seconds of one read, nothing beside it
    first_layer_s: float   # median seconds until it delivered layer 0


def read_alone(reader: Reader, iterations: int) -> ReadAlone:
    first = len(reader.seconds)
    for _ in range(iterations):
        reader.start_read()
        reader.done.acquire()
    return ReadAlone(statistics.median(reader.seconds[first:]),
                     statistics.median(reader.first_layer_s[first:]))


def build_store(root: str, num: int) -> tuple[PageStore, list[bytes], list[int]]:
    pool = HostKVPool(2 * num, LAYERS, PLANES, TOKENS, HEADS, DIM, torch.float16,
                      "layer_first", pin_memory=False, block_order=HEAD_MAJOR)
    raw = pool.buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    backend = create_backend("file", {"path": f"{root}/l3"}, StorageContext("worker", 0, 1, 64))
    store = PageStore(backend, pool,
                      KeyNamespace("bench/model", "float16", "layer_first", TOKENS, 1, 0))
    hashes = [os.urandom(32) for _ in range(num)]
    if not all(store.write(hashes, list(range(num)))):
        raise SystemExit("the write failed")
    return store, hashes, list(range(num, 2 * num))


def main() -> int:
    args = parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: the forward's and the reader's")
    torch.set_num_threads(1)
    compute_core, io_core = cores[-1], cores[0]
    root = tempfile.mkdtemp(prefix="hicache-read-forward-", dir=args.dir)
    try:
        store, hashes, targets = build_store(root, args.pages)
        reader = Reader(store, hashes, targets, io_core)
        reader.start()
        os.sched_setaffinity(0, {compute_core})
        print(f"forward: {args.layers} layers x {args.ops} ops ({args.rows} x {WIDTH} @ "
              f"{WIDTH} x {WIDTH}, fp32) on core {compute_core}; read: {args.pages} pages "
              f"by layer (layer_first, file, page cache) on core {io_core}; medians of "
              f"{args.iterations}")
        print("| switch interval | forward alone | + layer 0 alone | forward + read | "
              "cost beyond layer 0 | read alone | read + forward | ratio | "
              "main thread's waits per forward |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for interval_s in SWITCH_INTERVALS_S:
            sys.setswitchinterval(interval_s)
            alone = measure(reader, args, with_read=False)
            read = read_alone(reader, args.iterations)
            both = measure(reader, args, with_read=True)
            floor_s = alone.forward_s + read.first_layer_s
            print(f"| {interval_s * 1000:g} ms | {alone.forward_s * 1000:.2f} ms | "
                  f"{floor_s * 1000:.2f} ms | {both.forward_s * 1000:.2f} ms | "
                  f"{(both.forward_s - floor_s) * 1000:+.2f} ms | {read.read_s * 1000:.2f} ms | "
                  f"{both.read_s * 1000:.2f} ms | {both.read_s / read.read_s:.2f} | "
                  f"{alone.waits:.1f} -> {both.waits:.1f} |")
        store.backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
