"""HiRadixTree operations on a full L2, at two sizes (pure Python, no vLLM).

The tree and its traffic are benchmarks/bench_tree.py's: 64-page requests,
each sharing one of 16 system prefixes of 8 pages, arrive at a full tree.
Each size gets one tree, filled once; every benchmark leaves it full, so
they all see the steady state in which a new request must evict. Timed:

    new_request   match + lock + alloc (evicting) + unlock + insert: the cost
                  bench_tree.py reports per request
    match         lookup of a stored 64-page chain (no mutation)
    insert        insert of a 64-page chain whose pages are allocated
    evict         freeing 64 pages from the least recently used leaves

bench_tree.py also covers 1M pages and the other policies; filling 1M pages
takes longer than this whole suite should.
"""

from __future__ import annotations

import itertools
import random

import pytest
from bench_tree import PAGES_PER_REQUEST, PREFIXES, chain, new_request

from vllm_hicache.index import HiRadixTree
from vllm_hicache.policy import make_eviction_policy

SIZES_PAGES = (16384, 131072)
ROUNDS = 200

pytestmark = pytest.mark.benchmark(group="index")


class FullTree:
    """A tree kept full by requests with unique suffixes (seeded)."""

    def __init__(self, num_pages: int) -> None:
        self.tree = HiRadixTree(num_pages, make_eviction_policy("lru"))
        self._rng = random.Random(0)
        self._ids = itertools.count(1)
        self.last: list[bytes] = []
        self.refill()

    def next_chain(self) -> list[bytes]:
        return chain(self._rng.randrange(PREFIXES), next(self._ids))

    def add_request(self) -> None:
        self.last = self.next_chain()
        new_request(self.tree, self.last)

    def refill(self) -> None:
        while self.tree.num_free_pages >= PAGES_PER_REQUEST:
            self.add_request()


@pytest.fixture(scope="module", params=SIZES_PAGES, ids=lambda n: f"{n}pages")
def full(request) -> FullTree:
    return FullTree(request.param)


def test_new_request(benchmark, full: FullTree) -> None:
    benchmark.pedantic(lambda hashes: new_request(full.tree, hashes),
                       setup=lambda: ((full.next_chain(),), {}), rounds=ROUNDS, warmup_rounds=5)
    assert full.tree.num_free_pages < PAGES_PER_REQUEST


def test_match(benchmark, full: FullTree) -> None:
    full.add_request()  # the most recent chain: all its pages are in the tree
    result = benchmark(full.tree.match, full.last)
    assert len(result.pages) == PAGES_PER_REQUEST and None not in result.pages


def test_insert(benchmark, full: FullTree) -> None:
    def allocated() -> tuple[tuple, dict]:
        hashes = full.next_chain()
        matched = full.tree.match(hashes).pages
        lock = full.tree.lock(hashes, len(matched)) if matched else None
        pages = full.tree.alloc_up_to(len(hashes) - len(matched))  # evicts: untimed
        if lock is not None:
            full.tree.unlock(lock)
        return (hashes[: len(matched) + len(pages)], [None] * len(matched) + pages), {}

    unused = []
    benchmark.pedantic(lambda hashes, pages: unused.extend(full.tree.insert(hashes, pages)),
                       setup=allocated, rounds=ROUNDS, warmup_rounds=5)
    assert not unused


def test_evict(benchmark, full: FullTree) -> None:
    freed = []
    benchmark.pedantic(lambda: freed.append(full.tree.evict(PAGES_PER_REQUEST)),
                       setup=full.refill, rounds=ROUNDS, warmup_rounds=5)
    assert set(freed) == {PAGES_PER_REQUEST}
    full.refill()
