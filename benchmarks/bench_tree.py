"""Cost of one new request in the pure core at production L2 sizes.

HiRadixTree + an eviction policy, no vLLM: requests of 64 pages, each sharing
one of 16 system prefixes of 8 pages, arrive at a full tree; each is matched,
gets pages for its new blocks (evicting), and is inserted. Measured per new
request, after the tree is full, for the incremental eviction heap and for
the full sort it replaced (every unpinned leaf sorted at each eviction), in
the same process.

    .venv/bin/python benchmarks/bench_tree.py [--pages 16384 131072 1048576]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hicache.index import HiRadixTree  # noqa: E402
from vllm_hicache.policy import make_eviction_policy  # noqa: E402

PAGES_PER_REQUEST = 64
PREFIXES, PREFIX_PAGES = 16, 8


class FullSortTree(HiRadixTree):
    """The eviction it replaced: sort every unpinned leaf on each eviction."""

    def evict(self, num_pages: int) -> int:
        self._rebuild_heap()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[16384, 131072, 1048576])
    parser.add_argument("--policies", nargs="+", default=["lru", "lfu", "priority"])
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    print(f"{'pages':>9} {'policy':>8} {'incremental ms':>15} {'full sort ms':>13} {'ratio':>7}")
    for num_pages in args.pages:
        for policy in args.policies:
            new = measure(HiRadixTree, num_pages, policy, args.requests)
            old = measure(FullSortTree, num_pages, policy, args.requests)
            print(f"{num_pages:>9} {policy:>8} {new:>15.3f} {old:>13.3f} {new / old:>7.3f}")


if __name__ == "__main__":
    main()
