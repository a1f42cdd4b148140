"""An L3 hit's read per host memory layout: ``PageStore.read`` of one
document's pages from the ``file`` backend (page-cache resident: written
just before), checksum codec, for each ``hicache_mem_layout``.

``layer_first`` objects hold the canonical page order, so a read is staged:
the objects land in fresh buffers, then one copy puts them into the pool's
rows. The page-major layouts read straight into the pool (zero copy). The
L1 order is vLLM CPU's head-major block (``[planes, heads, tokens, dim]``),
or the canonical one (``--canonical``). Pages of the demo model (6 layers,
2 planes x 16 tokens x 4 heads x 64, fp16: 96 KiB).

Run: .venv/bin/python benchmarks/bench_l3_read_layouts.py [--dir DIR] [--pages 48] [--reads 40]
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
    return p.parse_args()


def median_read_s(layout: str, root: str, args: argparse.Namespace) -> tuple[float, int]:
    """Median seconds of one read of ``args.pages`` pages, and the bytes read."""
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
    seconds = []
    for _ in range(args.reads):
        started = time.perf_counter()
        read = store.read(hashes, list(range(num, 2 * num)))
        seconds.append(time.perf_counter() - started)
        if read != num:
            raise SystemExit(f"{layout}: read {read} of {num} pages")
    backend.close()
    return statistics.median(seconds), num * pool.bytes_per_page


def main() -> int:
    args = parse_args()
    root = tempfile.mkdtemp(prefix="hicache-read-layouts-", dir=args.dir)
    try:
        for layout in LAYOUTS:
            seconds, nbytes = median_read_s(layout, root, args)
            print(f"{layout:18s} {seconds * 1e3:6.2f} ms per read of {nbytes / 1e6:.1f} MB "
                  f"({nbytes / seconds / 1e9:.2f} GB/s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
