"""Node-tier hits loaded into L1 directly: bandwidth against the private
L2's load, and host memory of three instances sharing one tier (issue 22's
targets: >= 80% of the private path's bandwidth; three instances sharing a
tier of S hold at most S plus 5% of S each).

Bandwidth (one process, same L1 tensors): ``KVTransfer.load`` from a
private pool (L2 -> L1) against ``NodeDirectLoader.load`` from the tier's
segment (find or pin, seal checks, the copy, seal checks, release), in
batches of ``--batch`` pages (one request's hit). "segment copy only" is
the copy engine over the segment without the index or the checks; it
separates the copy from the tier's per-load costs. "direct, first load" is
a process's first load of the pages (found in the index, not remembered
from an earlier load); checksum objects are trusted by their seals (their
publisher checked them); with ``--secret`` (objects sealed with a MAC) it
includes each process's MAC check of a slot, once per slot generation.
"direct" is a later load of the same pages; "direct, in a step" the same
with the release on another thread, as a load in the step that admits its
request does (what the forward waits for).

Memory (three child processes): each joins the tier of ``--tier-mib``,
loads every page into its own L1 through the segment, and allocates a
private staging pool of ``--staging-mib``. Reported per process from
/proc/PID/smaps_rollup: Pss (the tier's pages split between the processes
that map them) and Pss_Anon (private memory), as deltas over the process
before it joined; and the tier file's allocated bytes (tmpfs blocks,
counted once for the machine). Host memory for KV = tier file + the sum of
the private deltas, against 3 x S for three private L2s of the same
working set.

Geometry: ``--layers`` x block of 16 tokens, 8 KV heads, head size 128,
bf16 (64 KiB per layer block); L1 on CPU, or CUDA when present
(the segment then registered with cudaHostRegister).

Run: .venv/bin/python benchmarks/bench_node_load.py [--pages 256] [--batch 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.host import HostKVPool  # noqa: E402
from vllm_hicache.kernels import describe_kv_tensor, make_transfer  # noqa: E402
from vllm_hicache.keys import KeyNamespace  # noqa: E402
from vllm_hicache.l3.node_loads import build_direct_loader  # noqa: E402
from vllm_hicache.node import NodeTier  # noqa: E402
from vllm_hicache.storage import StorageContext  # noqa: E402
from vllm_hicache.storage.format import HEADER_BYTES  # noqa: E402
from vllm_hicache.storage.node_chain import NodeChainBackend, node_key  # noqa: E402
from vllm_hicache.storage.pages import PageStore  # noqa: E402
from vllm_hicache.storage.sealing import make_codec  # noqa: E402
from vllm_hicache.storage_secret import StorageSecret  # noqa: E402

BLOCK, HEADS, HEAD_SIZE = 16, 8, 128
DTYPE = torch.bfloat16
MEM_LAYOUT = "page_first_direct"


class Rig:
    """L1 layers of ``num_blocks``, a private pool of ``num_pages``, and a
    membership of the tier at ``root`` with a PageStore writing into it."""

    def __init__(self, layers: int, num_blocks: int, num_pages: int, root: str,
                 tier_bytes: int, device: str, l1: torch.Tensor | None = None,
                 secret: bool = False) -> None:
        # As vLLM allocates them: one allocation, per-layer views; on CPU
        # [blocks, heads, block_size, 2 * head_size] (CPU_ATTN), on CUDA
        # [2, blocks, block_size, heads, head_size] (FLASH_ATTN).
        if l1 is not None:
            raw, backend = l1, "CPU_ATTN"
        elif device == "cpu":
            raw = torch.zeros((layers, num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE), dtype=DTYPE)
            backend = "CPU_ATTN"
        else:
            raw = torch.zeros((layers, 2, num_blocks, BLOCK, HEADS, HEAD_SIZE), dtype=DTYPE,
                              device=device)
            backend = "FLASH_ATTN"
        self.layers = [raw[i] for i in range(layers)]
        self.layouts = [describe_kv_tensor(t, num_blocks=num_blocks, block_size=BLOCK,
                                           num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                           is_mla=False, backend_name=backend)
                        for t in self.layers]
        self.pool = HostKVPool.for_layouts(num_pages, self.layouts, MEM_LAYOUT,
                                           pin_memory=device == "cuda")
        self.transfer = make_transfer("direct", self.layers, self.layouts, self.pool)
        object_bytes = HEADER_BYTES + self.pool.bytes_per_page
        self.tier = NodeTier.join("bench", f"bench-{layers}", tier_bytes, object_bytes,
                                  root=root)
        ctx = StorageContext("worker", 0, 1, object_bytes)
        ns = KeyNamespace("bench/model", "bfloat16", MEM_LAYOUT, BLOCK, 1, 0)
        codec = make_codec(StorageSecret(b"bench-node-load-secret-32-bytes!") if secret else None)
        self.store = PageStore(NodeChainBackend({}, ctx, tier=self.tier), self.pool, ns, codec)
        self.loader = build_direct_loader(self.tier, self.store, self.layers, self.layouts,
                                          "direct")

    def close(self) -> None:
        self.loader.close()
        self.store.backend.close()


def hashes(n: int) -> list[bytes]:
    return [i.to_bytes(32, "little") for i in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bandwidth(args: argparse.Namespace, root: str, device: str) -> None:
    n = args.pages
    page_bytes_guess = args.layers * 2 * BLOCK * HEADS * HEAD_SIZE * 2
    tier_bytes = (n + 8) * (page_bytes_guess + HEADER_BYTES + 4096)
    rig = Rig(args.layers, n, n, root, tier_bytes, device, secret=args.secret)
    pool = rig.pool
    pool.buffer.view(torch.int16).random_()
    keys = hashes(n)
    assert rig.store.write(keys, list(range(n))) == [True] * n
    batches = [(keys[i:i + args.batch], list(range(i, min(n, i + args.batch))))
               for i in range(0, n, args.batch)]
    total = n * pool.bytes_per_page

    def private() -> None:
        for _, ids in batches:
            rig.transfer.load(ids, ids)
        sync()

    def direct() -> None:
        for hs, ids in batches:
            assert rig.loader.load(hs, ids) == len(ids)

    held = rig.tier.hold_pages([node_key(k) for k in rig.store.keys(keys)])
    slots = [p.slot for p in held]
    slot_batches = [(ids, slots[ids[0]:ids[-1] + 1]) for _, ids in batches]

    def segment_copy() -> None:  # the copy alone: no index, seal or object checks
        for ids, at in slot_batches:
            rig.loader.transfer.load(ids, at)
        sync()

    def first_direct() -> None:
        rig.loader._verified.clear()  # as a process that has not checked them yet
        rig.tier._hints.clear()  # nor found them
        direct()

    releases = ThreadPoolExecutor(1)

    def in_step() -> None:  # as NodeLoadQueue in a step: the release on its thread
        for hs, ids in batches:
            assert rig.loader.load(hs, ids, releases.submit) == len(ids)

    rows = []
    for name, fn in (("private L2 -> L1", private), ("segment copy only", segment_copy),
                     ("direct, first load", first_direct), ("direct", direct),
                     ("direct, in a step", in_step)):
        fn()  # warm-up: first touches, plan caches
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            releases.submit(lambda: None).result()  # the releases, outside the timing
        rows.append((name, total / statistics.median(times) / 1e9))
    releases.shutdown()
    base = rows[0][1]
    print(f"\nbandwidth: {n} pages of {pool.bytes_per_page / 2**20:.2f} MiB, batches of "
          f"{args.batch}, L1 on {device}, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats}, objects sealed with {rig.store.codec.name}")
    print(f"{'path':<22}{'GB/s':>8}{'ratio':>8}")
    for name, gbs in rows:
        print(f"{name:<22}{gbs:>8.2f}{gbs / base:>8.2f}")
    rig.tier.release_pages(held, 0, 0)
    rig.close()


def smaps_rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out


def member(args: argparse.Namespace, root: str, tier_bytes: int, publish: bool,
           ready, go, report) -> None:
    torch.set_num_threads(1)
    staging_pages = max(1, args.staging_mib * 2**20 // (args.layers * 2 * BLOCK * HEADS
                                                        * HEAD_SIZE * 2))
    # L1 is vLLM's (GPU memory in production): allocated and touched before
    # the baseline, so the deltas are HiCache's host memory only.
    l1 = torch.zeros((args.layers, 64, HEADS, BLOCK, 2 * HEAD_SIZE), dtype=DTYPE)
    before = smaps_rollup(os.getpid())
    rig = Rig(args.layers, 64, staging_pages, root, tier_bytes, "cpu", l1=l1)
    n = rig.tier.geometry.num_slots
    keys = hashes(n)
    if publish:  # one instance computes the working set; the others only hit
        for i in range(0, n, staging_pages):
            chunk = keys[i:i + staging_pages]
            rig.pool.buffer.view(torch.int16)[:len(chunk)].random_()
            rig.store.write(chunk, list(range(len(chunk))))
    ready.set()
    go.wait()
    loaded = sum(rig.loader.load(keys[i:i + 64], list(range(len(keys[i:i + 64]))))
                 for i in range(0, n, 64))
    after = smaps_rollup(os.getpid())
    report.put((os.getpid(), loaded, {k: after.get(k, 0) - before.get(k, 0)
                                      for k in ("Pss", "Pss_Anon", "Pss_Shmem", "Rss")}))
    go.wait()  # stay alive (and mapped) until every member measured
    rig.close()


def memory(args: argparse.Namespace, root: str) -> None:
    ctx = mp.get_context("spawn")
    tier_bytes = args.tier_mib * 2**20
    report = ctx.Queue()
    go = ctx.Barrier(args.instances + 1)
    procs, readies = [], []
    for i in range(args.instances):
        ready = ctx.Event()
        p = ctx.Process(target=member, args=(args, root, tier_bytes, i == 0, ready, go, report))
        p.start()
        procs.append(p)
        readies.append(ready)
    for r in readies:
        r.wait(600)
    go.wait()
    rows = [report.get(timeout=600) for _ in procs]
    directory = next(Path(root).iterdir())
    tier_file = (directory / "pages").stat().st_blocks * 512
    go.wait()
    for p in procs:
        p.join(120)
    s = tier_bytes
    private = sum(r[2]["Pss_Anon"] for r in rows)
    print(f"\nmemory: {args.instances} instances, tier S = {s / 2**20:.0f} MiB, private "
          f"staging pool {args.staging_mib} MiB each (deltas over each process before "
          "it joined)")
    print(f"{'pid':>8}{'pages':>7}{'Pss MiB':>10}{'Pss_Shmem':>11}{'Pss_Anon':>10}{'Rss MiB':>9}")
    for pid, loaded, d in rows:
        print(f"{pid:>8}{loaded:>7}{d['Pss'] / 2**20:>10.1f}{d['Pss_Shmem'] / 2**20:>11.1f}"
              f"{d['Pss_Anon'] / 2**20:>10.1f}{d['Rss'] / 2**20:>9.1f}")
    total = tier_file + private
    print(f"tier file (tmpfs, once per machine): {tier_file / 2**20:.1f} MiB")
    print(f"host memory for KV: {total / 2**20:.1f} MiB = S x {total / s:.3f} "
          f"= S + {(total - s) / s / args.instances * 100:.1f}% of S per instance "
          f"(three private L2s of the working set: S x {args.instances})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--tier-mib", type=int, default=512)
    ap.add_argument("--staging-mib", type=int, default=8)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--secret", action="store_true",
                    help="seal the objects with a MAC (storage_secret): each process checks "
                         "a slot on its first load of it")
    args = ap.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="hicache-bench-node-", dir=base)
    try:
        bandwidth(args, root, device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.skip_memory:
        return
    root = tempfile.mkdtemp(prefix="hicache-bench-node-", dir=base)
    try:
        memory(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
