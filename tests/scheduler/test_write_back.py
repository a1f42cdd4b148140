"""WriteBackWatcher driven directly: a fake block pool, a real HiRadixTree;
EvictionWriteBacks on a real L2StorePlanner and page ops."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import pytest

from vllm_hicache.common.events import EventLog
from vllm_hicache.common.page_ops import OpKind, PageOps
from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.connector.geometry import KVGeometry
from vllm_hicache.index import HiRadixTree
from vllm_hicache.policy import make_eviction_policy
from vllm_hicache.policy.write import WritePolicy, hit_counter_slots
from vllm_hicache.scheduler.group_blocks import GroupBlocks
from vllm_hicache.scheduler.store_planner import L2StorePlanner
from vllm_hicache.scheduler.write_back import EvictionWriteBacks, WriteBackCopy, WriteBackWatcher

# vLLM keys its cached blocks by BlockHash + a 4-byte KV-cache group id.
GROUP_0 = (0).to_bytes(4, "big")


@dataclass
class FakeBlock:
    block_id: int
    block_hash: bytes | None = None


class FakeBlockPool:
    """What the watcher wraps of vLLM's BlockPool; ``evict`` plays vLLM reusing
    the blocks that cache the given hashes."""

    enable_caching = True

    def __init__(self, num_blocks: int = 0) -> None:
        self.blocks: list[FakeBlock] = [FakeBlock(i) for i in range(num_blocks)]
        self._by_hash: dict[bytes, FakeBlock] = {}
        self._free: list[FakeBlock] = self.blocks[::-1]
        self._to_reuse: list[FakeBlock] = []

    @property
    def num_gpu_blocks(self) -> int:
        return len(self.blocks)

    def cache(self, hashes) -> None:
        for h in hashes:
            if h in self._by_hash:
                continue
            if self._free:
                block = self._free.pop()
            else:
                block = FakeBlock(len(self.blocks))
                self.blocks.append(block)
            block.block_hash = h + GROUP_0
            self._by_hash[h] = block

    def block_id_of(self, block_hash: bytes) -> int:
        return self._by_hash[block_hash].block_id

    def evict(self, hashes) -> None:
        self._to_reuse = [self._by_hash.pop(h) for h in hashes]
        reused = self.get_new_blocks(len(self._to_reuse))
        self._free += reused

    # --- the BlockPool surface the watcher wraps ---

    def get_new_blocks(self, num_blocks: int) -> list[FakeBlock]:
        taken, self._to_reuse = self._to_reuse[:num_blocks], self._to_reuse[num_blocks:]
        for block in taken:
            self._maybe_evict_cached_block(block)
        return taken

    def _maybe_evict_cached_block(self, block: FakeBlock) -> bool:
        block.block_hash = None
        return True

    def reset_prefix_cache(self) -> bool:
        for block in self.blocks:
            if block.block_hash is not None:
                self._free.append(block)
            block.block_hash = None
        self._by_hash.clear()
        return True


class Rig:
    """A watcher, its pool and an L2 tree wired as the scheduler wires them."""

    def __init__(self, max_tracked_blocks: int, num_pages: int = 256) -> None:
        self.pool = FakeBlockPool()
        self.tree = HiRadixTree(
            num_pages, make_eviction_policy("lru"), on_evict=lambda hs: self.watcher.forget(hs)
        )
        self.watcher = WriteBackWatcher(self.pool, max_tracked_blocks)

    def alloc(self, chain, num_matched: int, num_pages: int):
        # As the scheduler does: never evict the chain being extended.
        lock = self.tree.lock(chain, num_matched) if num_matched else None
        try:
            return self.tree.alloc(num_pages)
        finally:
            if lock is not None:
                self.tree.unlock(lock)

    def compute(self, chain, lo: int = 0, hi: int | None = None) -> None:
        """vLLM computed blocks [lo, hi) of ``chain`` into L1."""
        hi = len(chain) if hi is None else hi
        self.pool.cache(chain[lo:hi])
        self.watcher.observe(chain, lo, hi)

    def evict(self, *hashes: bytes) -> list[WriteBackCopy]:
        """vLLM reuses these blocks; returns the write-backs planned."""
        ids = {h: self.pool.block_id_of(h) for h in hashes}
        self.pool.evict(hashes)
        copies = self.watcher.plan(self.tree, self.alloc)
        for copy in copies:
            assert copy.block_id == ids[copy.chain[-1]]
        return copies

    def in_l2(self, chain) -> bool:
        pages = self.tree.match(chain).pages
        return len(pages) == len(chain) and pages[-1] is not None


def names(*labels: str) -> list[bytes]:
    return [label.encode() * 8 for label in labels]


def test_hot_prefix_survives_trimming():
    # The reported defect: re-observed A, B kept their old position and were
    # trimmed, so C and B lost their chains and only A reached L2.
    rig = Rig(max_tracked_blocks=4)
    A, B, C, x, y, z = names("A", "B", "C", "x", "y", "z")
    rig.compute([A, B])
    rig.compute([x, y, z])
    rig.compute([A, B, C])
    rig.watcher.check_invariants()

    written = [copy.chain for h in (C, B, A) for copy in rig.evict(h)]

    assert written == [[A, B, C], [A, B], [A]]
    pages = rig.tree.match([A, B, C]).pages
    assert len(pages) == 3 and None not in pages
    rig.tree.check_integrity()
    rig.watcher.check_invariants()


def test_chain_longer_than_the_bound_keeps_its_prefix():
    # Leaves go first: the kept blocks still have whole chains.
    rig = Rig(max_tracked_blocks=4)
    chain = names(*"abcdefghij")
    rig.compute(chain)
    assert rig.watcher.num_tracked_blocks == 4

    assert rig.evict(chain[9]) == []
    assert [c.chain for c in rig.evict(chain[3])] == [chain[:4]]


def test_stale_child_does_not_drag_a_fresh_parent_out():
    # [A,B,C] is old; a later request ends at B. Trimming the stale C must
    # leave B where its own last use put it, not at the front.
    rig = Rig(max_tracked_blocks=5)
    A, B, C, p, q, r = names("A", "B", "C", "p", "q", "r")
    rig.compute([A, B, C])
    rig.compute([p])
    rig.compute([A, B])
    rig.compute([q, r])  # 6 > 5: C is the least recent leaf

    assert rig.watcher.num_tracked_blocks == 5
    assert rig.evict(C) == []
    assert [c.chain for c in rig.evict(B)] == [[A, B]]
    assert [c.chain for c in rig.evict(A)] == [[A]]


def test_parent_evicted_first_still_serves_its_child():
    # vLLM is not bound to evict leaf-first; the child walks through the
    # parent's L2 link.
    rig = Rig(max_tracked_blocks=8)
    A, B, C = names("A", "B", "C")
    rig.compute([A, B, C])

    assert [c.chain for c in rig.evict(B)] == [[A, B]]
    assert [c.chain for c in rig.evict(C)] == [[A, B, C]]
    assert [c.chain for c in rig.evict(A)] == [[A]]
    pages = rig.tree.match([A, B, C]).pages
    assert len(pages) == 3 and None not in pages
    rig.watcher.check_invariants()


def test_l2_evicting_a_parent_keeps_the_link_its_l1_child_needs():
    rig = Rig(max_tracked_blocks=8)
    A, B, C = names("A", "B", "C")
    rig.compute([A, B, C])
    assert [c.chain for c in rig.evict(B)] == [[A, B]]

    assert rig.tree.evict(1) == 1  # B, the only page
    assert not rig.in_l2([A, B])
    rig.watcher.check_invariants()

    assert [c.chain for c in rig.evict(C)] == [[A, B, C]]
    pages = rig.tree.match([A, B, C]).pages
    assert pages[:2] == [None, None] and pages[2] is not None  # A, B: placeholders
    rig.watcher.check_invariants()


def test_l2_eviction_and_clear_release_links():
    rig = Rig(max_tracked_blocks=8)
    A, B, C = names("A", "B", "C")
    rig.compute([A, B, C])
    for h in (C, B, A):
        assert len(rig.evict(h)) == 1
    assert rig.watcher.num_tracked_blocks == 0
    assert rig.watcher.num_parent_links == 3

    rig.tree.evict(1)  # C, the tree's only leaf
    assert rig.watcher.num_parent_links == 2
    rig.tree.clear()
    rig.watcher.clear_l2()
    assert rig.watcher.num_parent_links == 0
    rig.watcher.check_invariants()


def test_block_already_in_l2_is_not_copied_again():
    rig = Rig(max_tracked_blocks=8)
    A, B = names("A", "B")
    rig.compute([A, B])
    assert len(rig.evict(B)) == 1
    rig.compute([A, B])  # B loaded or recomputed into L1 again
    assert rig.evict(B) == []
    assert rig.in_l2([A, B])
    rig.watcher.check_invariants()


def test_prefix_cache_reset_writes_back_everything_tracked():
    rig = Rig(max_tracked_blocks=8)
    A, B, C = names("A", "B", "C")
    rig.compute([A, B, C])
    assert rig.pool.reset_prefix_cache()
    copies = rig.watcher.plan(rig.tree, rig.alloc)
    assert sorted(c.chain for c in copies) == [[A], [A, B], [A, B, C]]
    assert rig.watcher.num_tracked_blocks == 0
    rig.watcher.check_invariants()


def test_a_stop_writes_back_every_tracked_block_shallow_ones_first():
    rig = Rig(max_tracked_blocks=8)
    A, B, C, D, E = names("A", "B", "C", "D", "E")
    rig.compute([A, B, C])
    rig.compute([D, E])
    rig.pool.evict([E])  # E left L1 already (and went to L2 then)
    rig.watcher.plan(rig.tree, rig.alloc)
    cached = {h: b.block_id for h, b in rig.pool._by_hash.items()}
    assert rig.watcher.write_back_tracked(cached.get) == 4
    copies = rig.watcher.plan(rig.tree, rig.alloc)
    # Depth first, then the most recently observed: D (newer) before A.
    assert [c.chain for c in copies] == [[D], [A], [A, B], [A, B, C]]
    assert all(c.block_id == cached[c.chain[-1]] for c in copies)
    assert all(rig.in_l2(c.chain) for c in copies) and rig.in_l2([D, E])
    rig.watcher.check_invariants()


def test_inconsistent_chains_cannot_hang_the_trim():
    # Chained hashes never form a cycle; a caller bug must still not loop.
    rig = Rig(max_tracked_blocks=1)
    a, b = names("a", "b")
    rig.watcher.observe([b, a], 1, 2)  # a's parent is b
    rig.watcher.observe([a, b], 1, 2)  # b's parent is a
    assert rig.watcher.num_tracked_blocks == 1
    rig.watcher.check_invariants()


def test_insert_callback_pins_pages_within_one_plan():
    # One L2 page, two blocks evicted in the same step: the scheduler's
    # insert pins B's page, so C's alloc cannot hand the same page out again.
    rig = Rig(max_tracked_blocks=8, num_pages=1)
    A, B, C = names("A", "B", "C")
    rig.compute([A, B])
    rig.compute([C])
    pins = []

    def insert_pinned(chain, page):
        assert not rig.tree.insert(chain, [None] * (len(chain) - 1) + [page])
        pins.append(rig.tree.lock(chain, len(chain)))

    rig.pool.evict([B, C])
    copies = rig.watcher.plan(rig.tree, rig.alloc, insert_pinned)

    assert [c.chain for c in copies] == [[A, B]]
    assert len(pins) == 1 and rig.in_l2([A, B]) and not rig.in_l2([C])
    rig.watcher.check_invariants()
    rig.tree.unlock(pins[0])
    rig.tree.check_integrity()


def test_rejects_a_pool_without_prefix_caching():
    pool = FakeBlockPool()
    pool.enable_caching = False
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        WriteBackWatcher(pool, 8)


# --- EvictionWriteBacks: the scheduler half's glue -----------------------------


class StepRig:
    """EvictionWriteBacks wired as HiCacheScheduler wires it, on a pool of 8
    L1 blocks; ``compute`` plays what ``L2StorePlanner.advance`` reports."""

    def __init__(self, num_pages: int) -> None:
        self.pool = FakeBlockPool(num_blocks=8)
        self.stats = HiCacheStats()
        self.tree = HiRadixTree(num_pages, make_eviction_policy("lru"),
                                on_evict=lambda hs: self.write_backs.forget(hs))
        self.ops = PageOps(self.tree)
        geom = KVGeometry(block_size=16, layer_names=("l0",), bytes_per_block=0,
                          num_l1_blocks=8, num_kv_heads=2, head_size=8, is_mla=False)
        self.stores = L2StorePlanner(
            self.tree, self.ops, GroupBlocks(geom),
            WritePolicy("write_back", hit_counter_slots(num_pages)), self.stats, None, 16,
            EventLog(False, 16))
        self.step = 0
        self.write_backs = EvictionWriteBacks(self.stores, self.stats, lambda: self.step)
        self.write_backs.watch(self.pool)

    def compute(self, chain) -> None:
        self.pool.cache(chain)
        assert self.stores.write_back is not None
        self.stores.write_back.observe(chain, 0, len(chain))

    def next_step(self) -> None:
        """What build_connector_meta does first: acknowledge the last step."""
        self.step += 1
        self.ops.close_step(self.step)


def test_eviction_plans_a_pinned_copy_emitted_once():
    rig = StepRig(num_pages=4)
    A, B = names("A", "B")
    rig.compute([A, B])
    rig.step = 3
    block_b = rig.pool.block_id_of(B)
    rig.pool.evict([B])
    rig.write_backs.plan()

    copies = rig.write_backs.take()

    assert copies == [WriteBackCopy(block_b, copies[0].page, [A, B])]
    assert [(op.step, list(op.pages)) for op in rig.ops.live(OpKind.WRITE_BACK)] == [
        (3, [copies[0].page])]
    assert rig.tree.num_locked_pages == 1 and rig.stats.stored_blocks == 1
    assert rig.write_backs.take() == []  # emitted once, counted once
    assert rig.stats.stored_blocks == 1
    rig.next_step()  # the copy's step acknowledged: its pin goes
    assert rig.tree.num_locked_pages == 0
    rig.tree.check_integrity()


def test_every_page_pinned_skips_the_copy_and_counts_it():
    rig = StepRig(num_pages=1)
    A, C = names("A", "C")
    rig.compute([A])
    rig.compute([C])
    rig.pool.evict([A])
    rig.write_backs.plan()  # A's copy pins the only page until its step is acked
    rig.pool.evict([C])
    rig.write_backs.plan()

    copies = rig.write_backs.take()

    assert [c.chain for c in copies] == [[A]] and rig.ops.num_live(OpKind.WRITE_BACK) == 1
    assert rig.stats.store_skipped_blocks == 1 and rig.stats.stored_blocks == 1
    rig.tree.check_integrity()


def test_prefix_cache_reset_plans_between_steps():
    # vLLM resets its prefix cache between steps; the copies must be planned
    # (and indexed) at once, so the next step can already hit them.
    rig = StepRig(num_pages=4)
    A, B = names("A", "B")
    rig.compute([A, B])
    assert rig.pool.reset_prefix_cache()
    assert rig.tree.match([A, B]).num_blocks == 2

    copies = rig.write_backs.take()

    assert sorted(c.chain for c in copies) == [[A], [A, B]]


# --- randomized ---------------------------------------------------------------

MAX_CHAIN_BLOCKS = 5


def true_chain(tokens: list[int]) -> list[bytes]:
    hashes, prev = [], b""
    for token in tokens:
        prev = hashlib.sha256(prev + bytes([token])).digest()[:16]
        hashes.append(prev)
    return hashes


def run_random(seed: int, max_tracked: int, num_pages: int, leaf_first: bool) -> int:
    """300 steps of requests and L1 evictions; returns how many evictions
    had the guarantee checked.

    Guarantee: a block whose whole chain was observed within the last
    K = max_tracked - MAX_CHAIN_BLOCKS + 1 block observations is written
    back. Those K observations and the chain's own blocks are all T can
    hold ahead of it, so it cannot be the oldest leaf while T is over bound.
    """
    rng = random.Random(seed)
    rig = Rig(max_tracked, num_pages)
    window_obs = max_tracked - MAX_CHAIN_BLOCKS + 1
    chain_of: dict[bytes, list[bytes]] = {}
    last_obs: dict[bytes, int] = {}
    cached: set[bytes] = set()
    num_obs = checked = 0
    for _ in range(300):
        if not cached or rng.random() < 0.5:
            # Few tokens near the root: requests share prefixes.
            num_blocks = rng.randint(1, MAX_CHAIN_BLOCKS)
            tokens = [rng.randrange(2 if i < 2 else 4) for i in range(num_blocks)]
            chain = true_chain(tokens)
            split = rng.randint(0, len(chain))
            for lo, hi in ((0, split), (split, len(chain))):
                if lo < hi:
                    rig.compute(chain, lo, hi)
                    for i in range(lo, hi):
                        num_obs += 1
                        last_obs[chain[i]] = num_obs
                        chain_of[chain[i]] = chain[: i + 1]
            cached.update(chain)
        else:
            if leaf_first:
                parents = {chain_of[h][-2] for h in cached if len(chain_of[h]) > 1}
                candidates = sorted(cached - parents)
            else:
                candidates = sorted(cached)
            victim = rng.choice(candidates)
            chain = chain_of[victim]
            recent = min(last_obs[h] for h in chain) > num_obs - window_obs
            cached.discard(victim)
            copies = rig.evict(victim)
            assert len(copies) <= 1
            for copy in copies:
                assert copy.chain == chain
                assert rig.tree.match(chain).pages[-1] == copy.page
            if leaf_first and recent:
                checked += 1
                assert rig.in_l2(chain), (seed, victim.hex())
        assert rig.watcher.num_tracked_blocks <= max_tracked
        assert rig.watcher.num_parent_links <= max_tracked + rig.tree.num_cached_pages
        rig.watcher.check_invariants()
        rig.tree.check_integrity()
    return checked


@pytest.mark.parametrize("seed", range(6))
def test_random_leaf_first_evictions_write_back_recent_chains(seed):
    assert run_random(seed, max_tracked=12, num_pages=1024, leaf_first=True) >= 10


@pytest.mark.parametrize("seed", range(6))
def test_random_with_small_l2_keeps_bookkeeping_consistent(seed):
    # 8 pages: L2 evicts (forget) all the time.
    assert run_random(seed, max_tracked=12, num_pages=8, leaf_first=True) >= 10


@pytest.mark.parametrize("seed", range(6))
def test_random_any_order_evictions_keep_chains_right(seed):
    run_random(seed, max_tracked=10, num_pages=16, leaf_first=False)
