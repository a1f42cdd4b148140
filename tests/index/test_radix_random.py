"""Randomized HiRadixTree test against a reference model.

The model is a dict block hash -> page of the blocks that have an L2 page,
plus each hash's chain and the pages the test holds. After every operation
the tree must pass check_integrity and agree with the model: match() returns
exactly the model's page for every backed block, a placeholder only where the
model has no page, and (with no lock held) nothing beyond the deepest backed
block. Evictions, reported through on_evict, must skip locked blocks and go
leaf-first.
"""

from __future__ import annotations

import random

import pytest

from vllm_hicache.index import HiRadixTree
from vllm_hicache.policy import make_eviction_policy

NUM_PAGES = 40
OPS_PER_SEED = 2000
# Small alphabet and short chains: many shared prefixes, splits and re-inserts.
ALPHABET = 3
MAX_CHAIN = 8


class Model:
    def __init__(self, kit, rng: random.Random) -> None:
        self.kit, self.tree, self.rng = kit, kit.tree, rng
        self.hash_to_page: dict[bytes, int] = {}
        self.hash_to_chain: dict[bytes, list[bytes]] = {}
        self.held: list[int] = []  # allocated, not inserted
        self.locks: list[tuple[object, list[bytes]]] = []  # (handle, locked hashes)
        # Hashes invalidated while pinned: reported by on_evict once freed.
        self.orphan_hashes: list[bytes] = []
        self.invalidating = False
        kit.tree._on_evict = self.on_evict

    def random_chain(self) -> list[bytes]:
        tokens = [self.rng.randrange(ALPHABET) for _ in range(self.rng.randint(1, MAX_CHAIN))]
        hashes = self.kit.chain(tokens)
        for i, h in enumerate(hashes):
            self.hash_to_chain[h] = hashes[: i + 1]
        return hashes

    def on_evict(self, hashes: list[bytes]) -> None:
        if self.invalidating:
            return
        locked = {h for _, chain in self.locks for h in chain}
        evicted = []
        for h in hashes:
            page = self.hash_to_page.get(h)
            still_indexed = page is not None and (
                self.tree.match(self.hash_to_chain[h]).pages[-1:] == [page])
            if page is None or still_indexed:
                # An orphan's pages, freed by the unlock of its last pin.
                self.orphan_hashes.remove(h)
                continue
            assert h not in locked, "evicted a locked block"
            del self.hash_to_page[h]
            evicted.append(h)
        for h in self.hash_to_page:  # leaf-first: no evicted block has a kept extension
            assert not set(self.hash_to_chain[h]) & set(evicted)

    # --- operations (each returns nothing; asserts inline) -------------

    def op_insert(self) -> None:
        hashes = self.random_chain()[: self.rng.randint(1, MAX_CHAIN)]
        pages: list[int | None] = []
        for _ in hashes:
            give = self.held and self.rng.random() < 0.6
            pages.append(self.held.pop(self.rng.randrange(len(self.held))) if give else None)
        expected_unused = []
        for h, page in zip(hashes, pages):
            if page is None:
                continue
            if h in self.hash_to_page:
                expected_unused.append(page)
            else:
                self.hash_to_page[h] = page
        unused = self.tree.insert(hashes, pages, priority=self.rng.randrange(3))
        assert sorted(unused) == sorted(expected_unused)
        self.held += unused

    def op_alloc(self) -> None:
        want = self.rng.randint(0, 12)
        free_before = self.tree.num_free_pages
        pages = self.tree.alloc(want)
        if pages is None:
            assert self.tree.num_free_pages < want
            return
        assert len(pages) == want
        # Eviction makes up the shortfall exactly (tail trimming), never more.
        assert self.tree.num_free_pages == max(0, free_before - want)
        assert not set(pages) & set(self.hash_to_page.values()) and not set(pages) & set(self.held)
        self.held += pages

    def op_alloc_up_to(self) -> None:
        want = self.rng.randint(0, 12)
        tree = self.tree
        evictable = tree.num_free_pages + tree.num_cached_pages - tree.num_locked_pages
        pages = self.tree.alloc_up_to(want)
        # Never more than asked, never fewer than unpinned pages allow.
        assert len(pages) <= want and len(pages) >= min(want, evictable - self.num_pinned_orphan())
        assert not set(pages) & set(self.hash_to_page.values()) and not set(pages) & set(self.held)
        self.held += pages

    def num_pinned_orphan(self) -> int:
        """Pages held by orphans (invalidated, waiting for their pins)."""
        return self.tree.num_cached_pages - len(self.hash_to_page)

    def op_invalidate(self) -> None:
        hashes = self.random_chain()
        matched = self.tree.match(hashes).pages
        if not matched:
            assert not self.tree.invalidate(hashes, 0)
            return
        block = self.rng.randrange(len(matched))
        gone = hashes[block]
        below = [h for h in self.hash_to_page if gone in self.hash_to_chain[h]]
        pages = {h: self.hash_to_page.pop(h) for h in below}
        self.invalidating = True  # unpinned pages are freed (and reported) at once
        assert self.tree.invalidate(hashes, block) == len(below)
        self.invalidating = False
        free = set(self.tree._free.snapshot())
        # Pages not freed at once wait in a pinned orphan for their last pin.
        self.orphan_hashes += [h for h in below if pages[h] not in free]
        # A lock below the cut now pins an orphan, not whatever is re-inserted
        # under the same hashes later.
        self.locks = [(handle, chain[: chain.index(gone)] if gone in chain else chain)
                      for handle, chain in self.locks]
        # Placeholders above the cut may go too, when nothing else needs them.
        assert len(self.tree.match(hashes).pages) <= block, "an invalidated block still matches"

    def op_free(self) -> None:
        self.rng.shuffle(self.held)
        k = self.rng.randint(0, len(self.held))
        self.tree.free(self.held[:k])
        del self.held[:k]

    def op_evict(self) -> None:
        before = len(self.hash_to_page)
        freed = self.tree.evict(self.rng.randint(0, 10))
        assert freed == before - len(self.hash_to_page)

    def op_lock(self) -> None:
        hashes = self.random_chain()
        matched = len(self.tree.match(hashes).pages)
        if self.rng.random() < 0.1 and matched < len(hashes):
            with pytest.raises(ValueError):
                self.tree.lock(hashes, matched + 1)
            return
        k = self.rng.randint(0, matched)
        self.locks.append((self.tree.lock(hashes, k), hashes[:k]))

    def op_unlock(self) -> None:
        if self.locks:
            handle, _ = self.locks.pop(self.rng.randrange(len(self.locks)))
            self.tree.unlock(handle)

    def op_touch(self) -> None:
        hashes = self.random_chain()
        self.kit.clock.now += 1.0
        self.tree.touch(hashes, self.rng.randint(0, len(hashes)), self.rng.randrange(3))

    def op_clear(self) -> None:
        self.tree.clear()
        locked = {h for _, chain in self.locks for h in chain}
        kept = {}
        for h, page in self.hash_to_page.items():
            pages = self.tree.match(self.hash_to_chain[h]).pages
            if len(pages) == len(self.hash_to_chain[h]) and pages[-1] is not None:
                assert pages[-1] == page
                kept[h] = page
        assert {h for h in locked if h in self.hash_to_page} <= set(kept)
        if not self.locks:
            assert not kept
        self.hash_to_page = kept

    def op_match(self) -> None:
        self.check_chain(self.random_chain())

    # --- checks ----------------------------------------------------------

    def check_chain(self, hashes: list[bytes]) -> None:
        pages = self.tree.match(hashes).pages
        for h, page in zip(hashes, pages):
            assert page == self.hash_to_page.get(h), "match disagrees with the model"
        needed = set()
        for h in self.hash_to_page:
            needed.update(self.hash_to_chain[h])
        deepest = max((i + 1 for i, h in enumerate(hashes) if h in needed), default=0)
        assert len(pages) >= deepest, "a backed block's path is missing"
        if not self.locks:
            assert len(pages) == deepest, "a placeholder outlived its descendants"

    def check_all(self) -> None:
        for h, page in self.hash_to_page.items():
            assert self.tree.match(self.hash_to_chain[h]).pages[-1] == page
        orphaned = self.num_pinned_orphan()
        assert orphaned == len(self.orphan_hashes)
        assert (self.tree.num_free_pages + len(self.held) + len(self.hash_to_page) + orphaned
                == NUM_PAGES)


WEIGHTS = {
    "insert": 30, "match": 15, "alloc": 15, "free": 8, "lock": 8,
    "unlock": 12, "evict": 6, "touch": 8, "clear": 2, "alloc_up_to": 6, "invalidate": 5,
}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "mru", "filo", "priority"])
def test_random_ops_agree_with_model(make_kit, seed: int, policy: str) -> None:
    rng = random.Random(seed)
    kit = make_kit(num_pages=NUM_PAGES, policy=policy)
    model = Model(kit, rng)
    names, weights = list(WEIGHTS), list(WEIGHTS.values())
    for step in range(OPS_PER_SEED):
        name = rng.choices(names, weights)[0]
        getattr(model, f"op_{name}")()
        kit.tree.check_integrity()
        model.check_chain(model.random_chain())
        if step % 100 == 0:
            model.check_all()
    while model.locks:
        model.op_unlock()
    assert not model.tree.pinned_pages().orphaned, "an orphan outlived its last pin"
    assert not model.orphan_hashes
    kit.tree.clear()
    kit.tree.free(model.held)
    kit.tree.check_integrity()
    assert kit.tree.num_free_pages == NUM_PAGES


class FullSortTree(HiRadixTree):
    """Eviction as it was before the incremental heap: every unpinned leaf
    sorted by (policy key, node id) at the moment of eviction."""

    def evict(self, num_pages: int) -> int:
        self._queue.rebuild()
        return super().evict(num_pages)


def run_logged(make_kit, tree_cls, seed: int, policy: str) -> list:
    """Seeded random operations; returns everything the tree reported."""
    rng = random.Random(seed)
    kit = make_kit(num_pages=NUM_PAGES, policy=policy)
    kit.tree = tree_cls(NUM_PAGES, make_eviction_policy(policy), kit.clock)
    model = Model(kit, rng)
    log: list = []
    checked_on_evict = model.on_evict

    def on_evict(hashes):
        log.append(("evicted", list(hashes)))
        checked_on_evict(hashes)

    kit.tree._on_evict = on_evict
    names, weights = list(WEIGHTS), list(WEIGHTS.values())
    for _ in range(OPS_PER_SEED):
        name = rng.choices(names, weights)[0]
        getattr(model, f"op_{name}")()
        log.append((name, sorted(model.held), kit.tree.num_free_pages))
    return log


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "mru", "filo", "priority"])
def test_incremental_eviction_order_equals_a_full_sort(make_kit, seed: int, policy: str) -> None:
    incremental = run_logged(make_kit, HiRadixTree, seed, policy)
    full_sort = run_logged(make_kit, FullSortTree, seed, policy)
    assert sum(1 for entry in incremental if entry[0] == "evicted") > 20
    assert incremental == full_sort
