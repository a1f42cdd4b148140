"""An L3 hit's read per host memory layout: ``PageStore.read`` of one
document's pages from the ``file`` backend (page-cache resident: written
just before), checksum codec, for each ``hicache_mem_layout``.

``layer_first`` objects hold the canonical page order, so a read is staged:
the objects land in fresh buffers, then one copy puts them into the pool's
rows. The page-major layouts read straight into the pool (zero copy). The
L1 order is vLLM CPU's head-major block (``[planes, heads, tokens, dim]``),
or the canonical one (``--canonical``). Pages of the demo model (6 layers,
2 planes x 16 tokens x 4 heads x 64, fp16: 96 KiB).

For the layer-major layouts it also times ``PageStore.read_by_layer`` (the
read a same-step L1 copy can follow layer by layer): when the first layer
is in the pool, when the whole read has ended, checks included, and the
reading thread's CPU time for it (what competes with a forward beside it).
``--parts`` adds, per layer-major layout, the read by layer's mean time per
part (opening the objects, headers and first layers, the later layers, the
copies into the pool, the checks), each part timed by wrapping its method.

Run: .venv/bin/python benchmarks/bench_l3_read_layouts.py [--dir DIR] [--pages 48] [--reads 40]
     [--parts]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.host import HostKVPool  # noqa: E402
from vllm_hicache.host.layout import BlockOrder  # noqa: E402
from vllm_hicache.keys import KeyNamespace  # noqa: E402
from vllm_hicache.storage import StorageContext, create_backend  # noqa: E402
from vllm_hicache.storage.pages import PageStore  # noqa: E402

LAYERS, PLANES, TOKENS, HEADS, DIM = 6, 2, 16, 4, 64
HEAD_MAJOR = BlockOrder((PLANES, 1, TOKENS, HEADS, DIM),
                        (HEADS * TOKENS * DIM, 0, DIM, TOKENS * DIM, 1))
LAYOUTS = ("layer_first", "page_first_direct", "page_first")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="scratch parent directory (default: $TMPDIR)")
    p.add_argument("--pages", type=int, default=48, help="pages per read (one hit)")
    p.add_argument("--reads", type=int, default=40)
    p.add_argument("--canonical", action="store_true", help="L1 blocks in canonical order")
    p.add_argument("--parts", action="store_true", help="time the read by layer part by part")
    return p.parse_args()


class ReadTimes(NamedTuple):
    whole_s: float               # median seconds of PageStore.read
    nbytes: int                  # bytes one read brings in
    first_layer_s: float | None  # read_by_layer: median until layer 0 is in the pool
    by_layer_s: float | None     # read_by_layer: median of the whole call
    by_layer_cpu_s: float | None  # read_by_layer: median CPU time of the reading thread


def median_read_s(layout: str, root: str, args: argparse.Namespace) -> ReadTimes:
    """Medians of ``args.reads`` reads of ``args.pages`` pages each."""
    num = args.pages
    order = None if args.canonical else HEAD_MAJOR
    pool = HostKVPool(2 * num, LAYERS, PLANES, TOKENS, HEADS, DIM, torch.float16, layout,
                      pin_memory=False, block_order=None if layout == "page_first" else order)
    raw = pool.buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    backend = create_backend("file", {"path": f"{root}/{layout}"},
                             StorageContext("worker", 0, 1, 64))
    store = PageStore(backend, pool, KeyNamespace("bench/model", "float16", layout, TOKENS, 1, 0))
    hashes = [os.urandom(32) for _ in range(num)]
    if not all(store.write(hashes, list(range(num)))):
        raise SystemExit(f"{layout}: the write failed")
    seconds, first_s, layered_s, layered_cpu_s = [], [], [], []
    targets = list(range(num, 2 * num))
    for _ in range(args.reads):
        started = time.perf_counter()
        read = store.read(hashes, targets)
        seconds.append(time.perf_counter() - started)
        if read != num:
            raise SystemExit(f"{layout}: read {read} of {num} pages")
        if not store.reads_by_layer:
            continue
        landed: list[float] = []
        started, cpu_started = time.perf_counter(), time.thread_time()
        read = store.read_by_layer(hashes, targets,
                                   lambda layer, n: landed.append(time.perf_counter()))
        layered_s.append(time.perf_counter() - started)
        layered_cpu_s.append(time.thread_time() - cpu_started)
        first_s.append(landed[0] - started)
        if read != num:
            raise SystemExit(f"{layout}: read by layer {read} of {num} pages")
    if args.parts and store.reads_by_layer:
        print_parts(layout, store, hashes, targets, args.reads)
    backend.close()
    return ReadTimes(statistics.median(seconds), num * pool.bytes_per_page,
                     statistics.median(first_s) if first_s else None,
                     statistics.median(layered_s) if layered_s else None,
                     statistics.median(layered_cpu_s) if layered_cpu_s else None)


# read_by_layer's parts: (label, owner attribute or None for the store, method).
PARTS = (("opening the objects", "backend", "open_ranged"),
         ("headers and first layers", None, "_read_first_layer"),
         ("copies into the pool", "pool", "write_layer_payloads"),
         ("checks", None, "_open_objects"))


def print_parts(layout: str, store: PageStore, hashes: list[bytes], targets: list[int],
                reads: int) -> None:
    """Mean milliseconds per read of each part of ``read_by_layer`` (the
    later layers' reads are what the parts leave of the whole)."""
    spent = {label: 0.0 for label, _, _ in PARTS}
    patched = []
    for label, owner, name in PARTS:
        target = store if owner is None else getattr(store, owner)
        real = getattr(target, name)

        def timed(*args, _real=real, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - started

        setattr(target, name, timed)  # an instance attribute: this store only
        patched.append((target, name))
    whole_s = 0.0
    for _ in range(reads):
        started = time.perf_counter()
        store.read_by_layer(hashes, targets, lambda layer, n: None)
        whole_s += time.perf_counter() - started
    for target, name in patched:
        delattr(target, name)
    parts = "; ".join(f"{label} {v / reads * 1e3:.2f}" for label, v in spent.items())
    rest_s = whole_s - sum(spent.values())
    print(f"{layout:18s} read by layer, ms per read: {parts}; "
          f"later layers {rest_s / reads * 1e3:.2f}; whole {whole_s / reads * 1e3:.2f}", flush=True)


def main() -> int:
    args = parse_args()
    root = tempfile.mkdtemp(prefix="hicache-read-layouts-", dir=args.dir)
    try:
        for layout in LAYOUTS:
            t = median_read_s(layout, root, args)
            line = (f"{layout:18s} {t.whole_s * 1e3:6.2f} ms per read of {t.nbytes / 1e6:.1f} MB "
                    f"({t.nbytes / t.whole_s / 1e9:.2f} GB/s)")
            if t.first_layer_s is not None and t.by_layer_s is not None:
                line += (f"; by layer: first layer in {t.first_layer_s * 1e3:.2f} ms, "
                         f"all in {t.by_layer_s * 1e3:.2f} ms, "
                         f"CPU {(t.by_layer_cpu_s or 0) * 1e3:.2f} ms")
            print(line, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
