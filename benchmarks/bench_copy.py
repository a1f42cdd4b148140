"""L1 <-> L2 copy throughput per hicache_mem_layout x hicache_io_backend.

Measures ``KVTransfer.store`` (L1 -> L2) and ``load`` (L2 -> L1) over whole
blocks, with contiguous ids (one run) and scattered ids (a random
permutation: every block its own run), and compares each with
``np.copyto`` of the same number of bytes in the same process (the L1
allocation copied into the pool buffer, so the baseline allocates nothing).
Ratio = transfer GB/s / numpy GB/s; the target is >= 80%.

Default geometry: a Llama-3-8B-like block (32 layers, 8 KV heads, head
size 128, block size 32, bf16: 4 MiB per block over all layers) and 256
blocks, i.e. 1 GiB of L1 and 1 GiB of host pool; the L1 tensors are laid
out as vLLM's CPU backend allocates them (CPU_ATTN, one allocation, LBHNC).

The ``kernel`` backend needs CUDA (and Triton, and a pinned pool); where
it cannot run, one row per layout says what is missing.
The copies are memory-bound and use no BLAS: OPENBLAS_NUM_THREADS /
OMP settings for BLAS do not matter here. torch's intra-op thread count
does (``torch.get_num_threads()``, printed); numpy's copyto is
single-threaded.

Run: .venv/bin/python benchmarks/bench_copy.py [--blocks 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.host import MEM_LAYOUTS, HostKVPool  # noqa: E402
from vllm_hicache.kernels import (  # noqa: E402
    describe_kv_tensor,
    kernel_io_missing,
    make_transfer,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", default=",".join(MEM_LAYOUTS))
    parser.add_argument("--io-backends", default="direct,kernel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default)")
    return parser.parse_args()


def build_l1(args: argparse.Namespace, device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation, per-layer [blocks, heads, block_size, 2 * head_size] views."""
    shape = (args.layers, args.blocks, args.heads, args.block_size, 2 * args.head_size)
    raw = torch.empty(shape, dtype=torch.bfloat16, device=device)
    # Random bits, generated as int16 to stay cheap and NaN-agnostic.
    raw.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return raw, [raw[layer] for layer in range(args.layers)]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def numpy_baseline(raw: torch.Tensor, pool: HostKVPool, repeats: int) -> float:
    """Seconds for np.copyto of the L1 bytes into the pool buffer."""
    src = raw.view(torch.int16).view(-1).numpy()
    dst = pool.buffer.view(torch.int16).view(-1).numpy()
    assert src.nbytes == dst.nbytes
    return timed(lambda: np.copyto(dst, src), repeats)


def id_patterns(num_blocks: int, seed: int) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    blocks, pages = list(range(num_blocks)), list(range(num_blocks))
    rng.shuffle(blocks)
    rng.shuffle(pages)
    in_order = list(range(num_blocks))
    return {"contiguous": (in_order, in_order), "scattered": (blocks, pages)}


HEADER = (
    f"{'mem_layout':<18} {'io_backend':<15} {'ids':<11} {'dir':<6} "
    f"{'GB/s':>7} {'numpy':>7} {'ratio':>6}"
)


def describe_layers(args: argparse.Namespace, layers: list[torch.Tensor], device: str):
    backend = "CPU_ATTN" if device == "cpu" else "FLASH_ATTN"
    return [
        describe_kv_tensor(t, num_blocks=args.blocks, block_size=args.block_size,
                          num_kv_heads=args.heads, head_size=args.head_size, is_mla=False,
                          backend_name=backend)
        for t in layers
    ]


def build_pool(args: argparse.Namespace, mem_layout: str, layouts) -> HostKVPool:
    """A host pool with one page per L1 block, in vLLM's block order."""
    return HostKVPool(args.blocks, args.layers, 2, args.block_size, args.heads,
                      args.head_size, torch.bfloat16, mem_layout,
                      block_order=layouts[0].block_order)


def copy_call(transfer, direction: str, blocks: list[int], pages: list[int]):
    """One whole copy (``store``: L1 -> L2, ``load``: L2 -> L1), finished on return."""
    method = getattr(transfer, direction)

    def run() -> None:
        method(blocks, pages)
        transfer.synchronize()

    return run


def io_backend_missing(device_type: str, pool: HostKVPool) -> str:
    """What ``io_backend=kernel`` lacks here ('' when it can run)."""
    return kernel_io_missing(device_type == "cuda") or (
        "" if pool.is_pinned else "a pinned host pool")


def bench_layout(args, mem_layout: str, raw, layers, layouts, patterns) -> None:
    """Print one row per (io backend, id pattern, direction)."""
    total = raw.numel() * raw.element_size()
    pool = build_pool(args, mem_layout, layouts)
    base_gbps = total / numpy_baseline(raw.cpu(), pool, args.repeats) / 1e9
    for io_backend in args.io_backends.split(","):
        missing = io_backend == "kernel" and io_backend_missing(raw.device.type, pool)
        if missing:
            print(f"{mem_layout:<18} {io_backend:<15} not measured: needs {missing}")
            continue
        transfer = make_transfer(io_backend, layers, layouts, pool)
        for ids, (blocks, pages) in patterns.items():
            for direction in ("store", "load"):
                run = copy_call(transfer, direction, blocks, pages)
                gbps = total / timed(run, args.repeats) / 1e9
                print(f"{mem_layout:<18} {io_backend:<15} {ids:<11} {direction:<6} "
                      f"{gbps:7.2f} {base_gbps:7.2f} {gbps / base_gbps:6.0%}")


def main() -> None:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(
        f"device={device} torch={torch.__version__} torch_threads={torch.get_num_threads()} "
        f"cpus={os.cpu_count()} OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}"
    )
    raw, layers = build_l1(args, device)
    layouts = describe_layers(args, layers, device)
    total = raw.numel() * raw.element_size()
    print(f"geometry: {args.layers} layers x {args.heads} heads x {args.head_size} x block "
          f"{args.block_size}, bf16; {args.blocks} blocks = {total / 2**30:.2f} GiB per copy")
    print(HEADER)
    print("-" * len(HEADER))
    patterns = id_patterns(args.blocks, args.seed)
    for mem_layout in args.layouts.split(","):
        bench_layout(args, mem_layout, raw, layers, layouts, patterns)


if __name__ == "__main__":
    main()
