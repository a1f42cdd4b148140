"""GPU <-> host copy throughput of scattered KV pages, per layout x I/O backend.

For each page size (tokens per block: 16, 32, 64) and each
``hicache_mem_layout`` x ``hicache_io_backend`` pair, times ``KVTransfer.store``
(D2H: L1 blocks -> host pages) and ``load`` (H2D) of the same scattered
(block, page) pairs: a random permutation, so every block is its own run.
Two references move the same bytes in the same process:

* **contiguous**: one ``cudaMemcpyAsync`` between a contiguous device buffer
  and a contiguous pinned host buffer (torch ``copy_``): the practical limit;
* **torch index**: per layer, ``index_select`` of the blocks on the source
  device, one copy across PCIe/NVLink into a pinned staging buffer, then
  ``index_copy_`` into the pages on the destination: what a plain torch
  gather/scatter path costs.

Targets: the ``kernel`` backend >= 90% of contiguous, and >= 2x the torch
index path at 16-token pages. Each figure is the median wall time (issue +
``synchronize``) over ``--repeats`` runs after a warm-up, on a side stream
as the worker issues copies.

L1 tensors are shaped as vLLM 0.32 allocates them for FLASH_ATTN (one
allocation, per-layer ``[blocks, heads, tokens, 2 x head_size]`` views,
physical order LBNHC); the default geometry is a Llama-3-8B-like block (32
layers, 8 KV heads, head size 128, bf16: 128 KiB of KV per token).

Needs only torch and triton: ``vllm_hicache.host`` and ``vllm_hicache.kernels``
import without vLLM (the script checks). Without CUDA it exits with status 2.

    python benchmarks/gpu_transfer.py [--tokens 8192] [--page-sizes 16,32,64]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXIT_NO_CUDA = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per copy (all pages)")
    p.add_argument("--page-sizes", default="16,32,64")
    p.add_argument("--layouts", default="layer_first,page_first,page_first_direct")
    p.add_argument("--io-backends", default="kernel,direct")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` (issue + synchronize) on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def once() -> float:
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


class Geometry:
    def __init__(self, args: argparse.Namespace, block_size: int) -> None:
        self.layers, self.heads, self.head_size = args.layers, args.heads, args.head_size
        self.block_size = block_size
        self.pairs = max(1, args.tokens // block_size)
        # Room to scatter into: twice the copied blocks on both sides.
        self.num_blocks = self.num_pages = 2 * self.pairs
        self.dtype = torch.bfloat16

    @property
    def block_elems(self) -> int:  # one layer
        return self.heads * self.block_size * 2 * self.head_size

    @property
    def copy_bytes(self) -> int:
        return self.pairs * self.layers * self.block_elems * 2


def make_l1(g: Geometry, device: str = "cuda") -> list[torch.Tensor]:
    """Per-layer FLASH_ATTN views of one allocation, physical order LBNHC."""
    shape = (g.layers, g.num_blocks, g.heads, g.block_size, 2 * g.head_size)
    raw = torch.empty(g.layers * g.num_blocks * g.block_elems, dtype=g.dtype, device=device)
    raw.view(torch.int16).random_(-(2**15), 2**15 - 1)
    # LBNHC: layers, blocks, tokens, heads, content (outermost first).
    strides = [0] * 5
    step = 1
    for dim in (4, 2, 3, 1, 0):
        strides[dim] = step
        step *= shape[dim]
    view = raw.as_strided(shape, strides)
    return [view[layer] for layer in range(g.layers)]


def scattered_ids(g: Geometry, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    blocks, pages = list(range(g.num_blocks)), list(range(g.num_pages))
    rng.shuffle(blocks)
    rng.shuffle(pages)
    return blocks[:g.pairs], pages[:g.pairs]


def contiguous_gbps(g: Geometry, repeats: int) -> tuple[float, float]:
    """One cudaMemcpyAsync each way of the same bytes, pinned host memory."""
    dev = torch.empty(g.copy_bytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(g.copy_bytes, dtype=torch.uint8, pin_memory=True)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), repeats)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), repeats)
    return g.copy_bytes / d2h / 1e9, g.copy_bytes / h2d / 1e9


def torch_index_gbps(g: Geometry, layers, layouts, pool, blocks, pages,
                     repeats: int) -> tuple[float, float]:
    """Per layer: gather on the source device, one copy, scatter on the other."""
    segs = [layout.block_segments(t) for layout, t in zip(layouts, layers)]
    assert all(len(s) == 1 for s in segs), "LBNHC blocks are one contiguous run per layer"
    rows = pool.layout.rows(pool.buffer)  # [pages, layers, E]
    blocks_dev = torch.tensor(blocks, device="cuda")
    pages_cpu = torch.tensor(pages)
    staging = torch.empty((g.pairs, g.block_elems), dtype=g.dtype, pin_memory=True)
    gathered = torch.empty((g.pairs, g.block_elems), dtype=g.dtype, device="cuda")

    def d2h() -> None:
        for layer, (seg,) in enumerate(segs):
            torch.index_select(seg, 0, blocks_dev, out=gathered)
            staging.copy_(gathered, non_blocking=True)
            torch.cuda.current_stream().synchronize()  # the host reads staging next
            rows[:, layer].index_copy_(0, pages_cpu, staging)

    def h2d() -> None:
        for layer, (seg,) in enumerate(segs):
            torch.cuda.current_stream().synchronize()  # staging is free again
            torch.index_select(rows[:, layer], 0, pages_cpu, out=staging)
            gathered.copy_(staging, non_blocking=True)
            seg.index_copy_(0, blocks_dev, gathered)

    return g.copy_bytes / timed(d2h, repeats) / 1e9, g.copy_bytes / timed(h2d, repeats) / 1e9


def bench_transfer(transfer, g: Geometry, blocks, pages, repeats: int) -> tuple[float, float]:
    d2h = timed(lambda: transfer.store(blocks, pages), repeats)
    h2d = timed(lambda: transfer.load(blocks, pages), repeats)
    return g.copy_bytes / d2h / 1e9, g.copy_bytes / h2d / 1e9


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def run_page_size(args: argparse.Namespace, block_size: int, rows: list[str]) -> None:
    from vllm_hicache.host import HostKVPool
    from vllm_hicache.kernels import DirectTransfer, KernelTransfer, describe_kv_tensor

    g = Geometry(args, block_size)
    layers = make_l1(g)
    layouts = [describe_kv_tensor(t, num_blocks=g.num_blocks, block_size=g.block_size,
                                  num_kv_heads=g.heads, head_size=g.head_size, is_mla=False,
                                  backend_name="FLASH_ATTN") for t in layers]
    blocks, pages = scattered_ids(g, args.seed)
    c_d2h, c_h2d = contiguous_gbps(g, args.repeats)
    print(f"\npage {block_size} tokens: {g.pairs} scattered pages = "
          f"{g.copy_bytes / 2**20:.0f} MiB per copy; contiguous cudaMemcpyAsync "
          f"D2H {c_d2h:.1f} GB/s, H2D {c_h2d:.1f} GB/s", flush=True)
    torch_ref = None
    for mem_layout in args.layouts.split(","):
        pool = HostKVPool(g.num_pages, g.layers, 2, g.block_size, g.heads, g.head_size,
                          g.dtype, mem_layout, pin_memory=True,
                          block_order=layouts[0].block_order)
        if torch_ref is None and pool.layout.is_native:
            torch_ref = torch_index_gbps(g, layers, layouts, pool, blocks, pages, args.repeats)
            print(f"  torch index path: D2H {torch_ref[0]:.1f} GB/s, H2D {torch_ref[1]:.1f} GB/s")
        for io_backend in args.io_backends.split(","):
            cls = KernelTransfer if io_backend == "kernel" else DirectTransfer
            try:
                transfer = cls(layers, layouts, pool)
            except (ValueError, ImportError) as err:
                print(f"  {mem_layout:<18} {io_backend:<7} not run: {err}")
                continue
            d2h, h2d = bench_transfer(transfer, g, blocks, pages, args.repeats)
            for direction, gbps, base, ref in (("D2H", d2h, c_d2h, torch_ref and torch_ref[0]),
                                               ("H2D", h2d, c_h2d, torch_ref and torch_ref[1])):
                vs_torch = gbps / ref if ref else float("nan")
                line = (f"| {block_size} | {mem_layout} | {io_backend} | {direction} | "
                        f"{gbps:.1f} | {base:.1f} | {gbps / base:.0%} | "
                        f"{ref or float('nan'):.1f} | {vs_torch:.1f}x |")
                if io_backend == "kernel":
                    line += f" {verdict(gbps / base >= 0.9)}"
                    if block_size == 16:
                        line += f", {verdict(vs_torch >= 2.0)}"
                    line += " |"
                else:
                    line += " |"
                rows.append(line)
                print(" ", line, flush=True)
        pool.close()
    del layers
    torch.cuda.empty_cache()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("gpu_transfer.py: no CUDA device is available (torch.cuda.is_available() is "
              "False); this benchmark measures GPU <-> host copies and needs one. "
              "For the CPU copy paths run benchmarks/bench_copy.py.", file=sys.stderr)
        return EXIT_NO_CUDA
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_transfer.py: unset TRITON_INTERPRET (the kernels must be compiled)",
              file=sys.stderr)
        return EXIT_NO_CUDA
    # The packages load their modules lazily: import the ones this run uses.
    import vllm_hicache.host.pool  # noqa: F401
    import vllm_hicache.kernels.factory  # noqa: F401

    leaked = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    if leaked:
        print(f"note: importing vllm_hicache.host/kernels imported vLLM ({leaked[:3]})")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"geometry: {args.layers} layers x {args.heads} KV heads x {args.head_size}, bf16, "
          f"FLASH_ATTN LBNHC; {args.tokens} tokens per copy; median of {args.repeats}")
    rows = ["| page tokens | mem_layout | io_backend | dir | GB/s | contiguous GB/s | "
            "vs contiguous | torch index GB/s | vs torch | kernel targets (>=90%, >=2x @16) |",
            "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for block_size in (int(s) for s in args.page_sizes.split(",")):
        run_page_size(args, block_size, rows)
    print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
