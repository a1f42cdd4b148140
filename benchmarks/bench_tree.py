"""Cost of one new request in the pure core at production L2 sizes.

HiRadixTree + an eviction policy, no vLLM: requests of 64 pages, each sharing
one of 16 system prefixes of 8 pages, arrive at a full tree; each is matched,
gets pages for its new blocks (evicting), and is inserted. Measured per new
request, after the tree is full, for the incremental eviction heap and for
the full sort it replaced (every unpinned leaf sorted at each eviction), in
the same process.

Then the index's memory at ``--memory-pages`` (default 1M): bytes per page
(tracemalloc, block hashes included: once their requests are gone the tree
holds the only reference), objects the garbage collector tracks, and the time
of one full collection, for two shapes: conversations of 64 pages stored in
four pieces (as chunked prefill and decode store them), and the worst case,
one page per node.

    .venv/bin/python benchmarks/bench_tree.py [--pages 16384 131072 1048576]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.index import HiRadixTree  # noqa: E402
from vllm_hicache.policy import make_eviction_policy  # noqa: E402

PAGES_PER_REQUEST = 64
PREFIXES, PREFIX_PAGES = 16, 8


class FullSortTree(HiRadixTree):
    """The eviction it replaced: sort every unpinned leaf on each eviction."""

    def evict(self, num_pages: int) -> int:
        self._queue.rebuild()
        return super().evict(num_pages)


def chain(prefix: int, request: int) -> list[bytes]:
    hashes, prev = [], b"root"
    for i in range(PAGES_PER_REQUEST):
        token = prefix if i < PREFIX_PAGES else request
        prev = hashlib.blake2b(prev + token.to_bytes(8, "little") + bytes([i]),
                               digest_size=16).digest()
        hashes.append(prev)
    return hashes


def new_request(tree: HiRadixTree, hashes: list[bytes]) -> None:
    matched = tree.match(hashes).pages
    lock = tree.lock(hashes, len(matched)) if matched else None
    pages = tree.alloc_up_to(len(hashes) - len(matched))
    if lock is not None:
        tree.unlock(lock)
    tree.insert(hashes[: len(matched) + len(pages)], [None] * len(matched) + pages)


def measure(tree_cls, num_pages: int, policy: str, num_timed: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    tree = tree_cls(num_pages, make_eviction_policy(policy))
    request = 0
    while tree.num_free_pages > PAGES_PER_REQUEST:  # fill L2
        request += 1
        new_request(tree, chain(rng.randrange(PREFIXES), request))
    chains = []
    for _ in range(num_timed):
        request += 1
        chains.append(chain(rng.randrange(PREFIXES), request))
    start = time.perf_counter()
    for hashes in chains:
        new_request(tree, hashes)
    return (time.perf_counter() - start) / num_timed * 1e3


def memory(num_pages: int, chain_pages: int, pieces: int) -> tuple[float, int, float]:
    """(bytes per page, GC-tracked objects, seconds of a full collection)."""
    gc.collect()
    tracemalloc.start()
    tree = HiRadixTree(num_pages, make_eviction_policy("lru"))
    conv = 0
    while tree.num_free_pages >= chain_pages:
        conv += 1
        seed = hashlib.sha256(conv.to_bytes(8, "little")).digest()
        hashes = [hashlib.sha256(seed + i.to_bytes(4, "little")).digest()
                  for i in range(chain_pages)]
        step = max(1, chain_pages // pieces)
        for end in range(step, chain_pages + 1, step):  # stored piece by piece
            pages = tree.alloc(step)
            tree.insert(hashes[:end], [None] * (end - step) + pages)
    gc.collect()
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tracked = len(gc.get_objects())
    start = time.perf_counter()
    gc.collect()
    pause_s = time.perf_counter() - start
    del tree
    return used / num_pages, tracked, pause_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[16384, 131072, 1048576])
    parser.add_argument("--policies", nargs="+", default=["lru", "lfu", "priority"])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--memory-pages", type=int, default=1 << 20)
    args = parser.parse_args()
    print(f"{'pages':>9} {'policy':>8} {'incremental ms':>15} {'full sort ms':>13} {'ratio':>7}")
    for num_pages in args.pages:
        for policy in args.policies:
            new = measure(HiRadixTree, num_pages, policy, args.requests)
            old = measure(FullSortTree, num_pages, policy, args.requests)
            print(f"{num_pages:>9} {policy:>8} {new:>15.3f} {old:>13.3f} {new / old:>7.3f}")
    print(f"\n{'pages':>9} {'shape':>28} {'bytes/page':>11} {'GC objects':>11} "
          f"{'full GC ms':>11}")
    for shape, chain_pages, pieces in (("64-page chains in 4 pieces", 64, 4),
                                       ("one page per node", 1, 1)):
        per_page, tracked, pause = memory(args.memory_pages, chain_pages, pieces)
        print(f"{args.memory_pages:>9} {shape:>28} {per_page:>11.1f} {tracked:>11} "
              f"{pause * 1e3:>11.1f}")


if __name__ == "__main__":
    main()
