"""HiRadixTree: match, insert (splits, placeholders), locks, alloc/evict, clear.

Fixtures (conftest.py): ``kit`` is a 16-page LRU tree with a fake clock;
``kit.put`` inserts with fresh pages and checks integrity.
"""

from __future__ import annotations

import pytest

from vllm_hicache.index import MatchResult


def test_match_on_empty_tree(kit) -> None:
    result = kit.tree.match(kit.chain([1, 2, 3]))
    assert result == MatchResult([])
    assert result.host_run(0) == []
    assert kit.tree.match([]).pages == []


def test_match_full_partial_and_longer(kit) -> None:
    pages = kit.put(kit.chain([1, 2, 3, 4]))
    assert kit.tree.match(kit.chain([1, 2, 3, 4])).pages == pages
    assert kit.tree.match(kit.chain([1, 2, 3, 4, 5, 6])).pages == pages
    assert kit.tree.match(kit.chain([1, 2])).pages == pages[:2]
    assert kit.tree.match(kit.chain([1, 2, 9, 4])).pages == pages[:2]
    assert kit.tree.match(kit.chain([9])).pages == []


def test_match_has_no_side_effects(kit) -> None:
    kit.put(kit.chain([1, 2, 3, 4]))
    node = kit.tree.root_view().children[kit.chain([1])[0]]
    kit.clock.now = 5.0
    kit.tree.match(kit.chain([1, 2, 9]))
    assert kit.num_nodes() == 1  # a diverging match does not split
    assert (node.last_access_time, node.hit_count) == (0.0, 0)


def test_host_run_stops_at_placeholders_and_end() -> None:
    result = MatchResult([None, None, 7, 8, None, 9])
    assert result.host_run(0) == []
    assert result.host_run(2) == [7, 8]
    assert result.host_run(3) == [8]
    assert result.host_run(5) == [9]
    assert result.host_run(6) == []
    assert result.num_blocks == 6


def test_missing_lists_placeholders_then_blocks_past_the_match() -> None:
    result = MatchResult([None, 7, None, 8])
    assert result.missing(0, 6) == [0, 2, 4, 5]
    assert result.missing(1, 3) == [2]
    assert result.missing(3, 4) == []
    assert result.missing(5, 7) == [5, 6]
    assert result.missing(2, 2) == []


def test_insert_divergence_splits_and_returns_existing_pages(kit) -> None:
    a = kit.put(kit.chain([1, 2, 3, 4]))
    b_hashes = kit.chain([1, 2, 7, 8])
    b_pages = kit.tree.alloc(4)
    assert kit.tree.insert(b_hashes, b_pages) == b_pages[:2]  # blocks 0-1 already held
    kit.tree.free(b_pages[:2])
    kit.tree.check_integrity()
    assert kit.num_nodes() == 3  # shared head, two tails
    assert kit.tree.match(kit.chain([1, 2, 3, 4])).pages == a
    assert kit.tree.match(b_hashes).pages == a[:2] + b_pages[2:]
    assert kit.tree.num_cached_pages == 6


def test_insert_extends_a_leaf(kit) -> None:
    a = kit.put(kit.chain([1, 2]))
    b = kit.put(kit.chain([1, 2, 3]), [False, False, True])
    assert kit.tree.match(kit.chain([1, 2, 3])).pages == a + b[2:]
    assert kit.num_nodes() == 1  # grown in place: a chain stored in pieces is one node
    kit.tree.check_integrity()


def test_extended_leaf_pinned_by_an_earlier_lock(kit) -> None:
    hashes = kit.chain([1, 2, 3, 4])
    kit.put(hashes[:2])
    handle = kit.tree.lock(hashes, 2)
    kit.put(hashes, [False, False, True, True])
    # The pin holds the whole node, new pages included, until it is released.
    assert kit.tree.num_locked_pages == 4
    assert kit.tree.evict(4) == 0
    kit.tree.check_integrity()
    kit.tree.unlock(handle)
    assert kit.tree.num_locked_pages == 0
    assert kit.tree.evict(1) == 1  # from the tail
    assert kit.tree.match(hashes).num_blocks == 3
    kit.tree.check_integrity()


def test_extension_after_a_placeholder_gap_branches(kit) -> None:
    hashes = kit.chain([1, 2, 3, 4])
    kit.put(hashes[:1])
    kit.put(hashes, [False, True, False, True])
    pages = kit.tree.match(hashes).pages
    assert pages[2] is None and None not in (pages[0], pages[1], pages[3])
    assert kit.num_nodes() == 3  # [1, 2] grown in place, placeholder [3], leaf [4]
    kit.tree.check_integrity()


def test_placeholders_created_then_filled(kit) -> None:
    hashes = kit.chain([1, 2, 3, 4])
    tail = kit.put(hashes, [False, False, True, True])
    assert kit.tree.match(hashes).pages == [None, None] + tail[2:]
    assert kit.tree.match(hashes).host_run(2) == tail[2:]
    head = kit.put(hashes, [True, False, False, False])  # splits the placeholder
    assert kit.tree.match(hashes).pages == [head[0], None] + tail[2:]
    mid = kit.put(hashes, [False, True, False, False])
    assert kit.tree.match(hashes).pages == [head[0], mid[1]] + tail[2:]
    assert kit.tree.num_cached_pages == 4


def test_trailing_pageless_blocks_are_not_inserted(kit) -> None:
    pages = kit.put(kit.chain([1, 2, 3]), [True, False, False])
    assert kit.tree.match(kit.chain([1, 2, 3])).pages == pages[:1]
    kit.put(kit.chain([5, 6]), [False, False])
    assert kit.tree.match(kit.chain([5, 6])).pages == []


def test_placeholder_pruned_with_its_last_descendant(kit) -> None:
    kit.put(kit.chain([1, 2, 3]), [False, False, True])
    assert kit.tree.evict(1) == 1
    kit.tree.check_integrity()
    assert kit.num_nodes() == 0
    assert kit.tree.match(kit.chain([1, 2, 3])).pages == []


def test_insert_rejects_bad_pages(kit) -> None:
    with pytest.raises(ValueError, match="allocated"):
        kit.tree.insert(kit.chain([1]), [3])  # never allocated
    pages = kit.tree.alloc(1)
    with pytest.raises(ValueError, match="distinct"):
        kit.tree.insert(kit.chain([1, 2]), pages * 2)
    with pytest.raises(ValueError, match="pages for a chain"):
        kit.tree.insert(kit.chain([1]), [pages[0], None])
    kit.tree.check_integrity()


def test_free_and_double_free(kit) -> None:
    pages = kit.tree.alloc(3)
    assert pages == [0, 1, 2] and kit.tree.num_free_pages == 13
    kit.tree.check_integrity()
    kit.tree.free(pages)
    assert kit.tree.num_free_pages == 16
    with pytest.raises(ValueError, match="not allocated"):
        kit.tree.free(pages[:1])
    kit.tree.check_integrity()


def test_lock_protects_from_evict_and_alloc(make_kit) -> None:
    kit = make_kit(num_pages=6)
    a_hashes = kit.chain([1, 2, 3])
    a = kit.put(a_hashes)
    kit.put(kit.chain([4, 5, 6]))
    handle = kit.tree.lock(a_hashes, 2)  # pins the whole 3-block node
    assert kit.tree.num_locked_pages == 3
    assert kit.tree.alloc(4) is None  # evicts the other chain, still short
    kit.tree.check_integrity()
    assert kit.tree.num_free_pages == 3
    assert kit.tree.evict(3) == 0
    assert kit.tree.match(a_hashes).pages == a
    kit.tree.unlock(handle)
    assert kit.tree.num_locked_pages == 0
    assert kit.tree.alloc(4) is not None
    kit.tree.check_integrity()


def test_lock_errors(kit) -> None:
    hashes = kit.chain([1, 2, 3])
    kit.put(hashes[:2])
    with pytest.raises(ValueError, match="only 2"):
        kit.tree.lock(hashes, 3)
    handle = kit.tree.lock(hashes, 0)  # pins nothing, still needs one unlock
    kit.tree.unlock(handle)
    with pytest.raises(RuntimeError, match="already unlocked"):
        kit.tree.unlock(handle)
    kit.tree.check_integrity()


def test_lock_survives_a_split(kit) -> None:
    a_hashes = kit.chain([1, 2, 3, 4])
    kit.put(a_hashes)
    handle = kit.tree.lock(a_hashes, 4)
    kit.put(kit.chain([1, 2, 7]), [False, False, True])  # splits the locked node
    kit.tree.check_integrity()
    assert kit.tree.num_locked_pages == 4
    kit.tree.unlock(handle)
    kit.tree.check_integrity()
    assert kit.tree.num_locked_pages == 0
    assert kit.tree.evict(16) == 5


def test_locked_placeholder_outlives_its_children(kit) -> None:
    hashes = kit.chain([1, 2])
    kit.put(hashes, [False, True])
    handle = kit.tree.lock(hashes, 1)  # the path ends at a placeholder
    assert kit.tree.evict(1) == 1
    kit.tree.check_integrity()
    assert kit.tree.match(hashes).pages == [None]
    kit.tree.unlock(handle)  # now childless and unlocked: pruned
    kit.tree.check_integrity()
    assert kit.num_nodes() == 0


def test_alloc_evicts_leaf_first_and_trims_the_tail(make_kit) -> None:
    kit = make_kit(num_pages=4)
    hashes = kit.chain([1, 2, 3, 4])
    kit.put(hashes[:2])
    kit.clock.now = 1.0
    tail = kit.put(hashes, [False, False, True, True])
    kit.clock.now = 2.0
    kit.tree.touch(hashes, 2)  # a use of the head is a use of the node it is in
    pages = kit.tree.alloc(1)
    assert pages == tail[3:]  # block 3's page, trimmed off the leaf's tail
    assert kit.evicted == hashes[3:]
    assert kit.tree.match(hashes).pages == [0, 1, 2]
    kit.tree.free(pages)
    assert kit.tree.evict(2) == 2  # two more off the tail, block 0 stays
    assert kit.evicted == hashes[3:] + hashes[1:3]
    assert kit.tree.match(hashes).pages == [0]
    kit.tree.check_integrity()


def test_evict_returns_what_it_freed(kit) -> None:
    kit.put(kit.chain([1, 2, 3]))
    assert kit.tree.evict(0) == 0
    assert kit.tree.evict(10) == 3
    assert kit.tree.num_cached_pages == 0 and kit.tree.num_free_pages == 16
    assert kit.tree.evict(1) == 0
    kit.tree.check_integrity()


def test_insert_and_touch_update_stats(kit) -> None:
    hashes = kit.chain([1, 2])
    kit.put(hashes)
    node = kit.tree.root_view().children[hashes[0]]
    assert (node.creation_time, node.hit_count, node.priority) == (0.0, 0, 0)
    kit.clock.now = 3.0
    kit.tree.touch(hashes, 1, priority=5)
    assert (node.last_access_time, node.hit_count, node.priority) == (3.0, 1, 5)
    kit.tree.touch(hashes, 2, priority=1)  # priority keeps the max
    assert (node.hit_count, node.priority) == (2, 5)
    kit.tree.touch(kit.chain([9]), 1)  # not in the tree: ignored


def test_reinsert_counts_a_hit_and_fill_resets_creation(kit) -> None:
    hashes = kit.chain([1, 2, 3])
    kit.put(hashes, [False, True, True])
    kit.clock.now = 4.0
    kit.put(hashes[:1] + hashes[1:2], [True, False])  # fills block 0, re-hits block 1
    tail = kit.tree.root_view().children[hashes[0]].children[hashes[1]]
    head = tail.parent
    assert (head.creation_time, head.hit_count) == (4.0, 0)
    assert (tail.creation_time, tail.last_access_time, tail.hit_count) == (0.0, 4.0, 1)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("lru", "yzx"), ("lfu", "yxz"), ("fifo", "xyz"),
        ("mru", "xzy"), ("filo", "zyx"), ("priority", "zxy"),
    ],
)
def test_policy_orders_eviction(make_kit, policy: str, expected: str) -> None:
    kit = make_kit(policy=policy)
    leaves = {name: kit.chain([i]) for i, name in enumerate("xyz")}
    for t, name in enumerate("xyz", start=1):  # creation: x < y < z
        kit.clock.now = float(t)
        kit.put(leaves[name])
    # (time, leaf, priority): hits y1 x2 z3; last access y4 z5 x6; priority z0 x1 y2
    touches = [(3.5, "x", 1), (3.6, "z", 0), (3.7, "z", 0), (4, "y", 2), (5, "z", 0), (6, "x", 1)]
    for t, name, priority in touches:
        kit.clock.now = t
        kit.tree.touch(leaves[name], 1, priority)
    for _ in range(3):
        assert kit.tree.evict(1) == 1
    order = "".join(next(n for n in "xyz" if leaves[n][0] == h) for h in kit.evicted)
    assert order == expected


def test_clear_keeps_locked_paths(kit) -> None:
    locked = kit.chain([1, 2, 3])
    # The child first (its parent a placeholder, then filled), so it stays a
    # separate node: an unlocked child of a locked node.
    kit.put(kit.chain([1, 2, 3, 4]), [False] * 3 + [True])
    kept = kit.put(locked)
    kit.put(kit.chain([5, 6]))
    pending = kit.tree.alloc(2)  # allocated, not inserted: untouched by clear
    handle = kit.tree.lock(locked, 3)
    kit.tree.clear()
    kit.tree.check_integrity()
    assert kit.tree.match(kit.chain([1, 2, 3, 4])).pages == kept
    assert kit.tree.match(kit.chain([5, 6])).pages == []
    assert kit.tree.num_cached_pages == 3 and kit.evicted == []
    kit.tree.unlock(handle)
    kit.tree.clear()
    kit.tree.free(pending)
    assert kit.tree.num_free_pages == 16
    kit.tree.check_integrity()


def test_check_integrity_reports_numbers(kit) -> None:
    kit.put(kit.chain([1]))
    kit.tree._num_cached_pages += 1
    with pytest.raises(RuntimeError, match=r"cached pages counted 2, actual 1"):
        kit.tree.check_integrity()


def test_invalidate_twice_on_one_chain_frees_both_orphans(kit):
    """A cut below an earlier cut: one unlock releases both orphans."""
    hashes = kit.chain(range(6))
    kit.put(hashes)
    tree = kit.tree
    lock = tree.lock(hashes, 6)
    assert tree.invalidate(hashes, 4) == 2  # blocks 4 and 5
    assert tree.invalidate(hashes, 2) == 2  # blocks 2 and 3
    assert tree.match(hashes).pages == kit.tree.match(hashes[:2]).pages
    assert len(tree.match(hashes).pages) == 2
    tree.check_integrity()
    assert tree.num_free_pages == 16 - 6
    tree.unlock(lock)
    tree.check_integrity()
    assert tree.num_free_pages == 16 - 2
    assert tree.pinned_pages() == (frozenset(), frozenset())


def test_alloc_up_to_never_takes_pinned_pages(kit):
    pinned, loose = kit.chain(range(8)), kit.chain([9, 9])
    kit.put(pinned)
    kit.put(loose)
    tree = kit.tree
    lock = tree.lock(pinned, 8)
    got = tree.alloc_up_to(12)
    # 6 free + the 2 unpinned pages; the 8 pinned pages stay.
    assert len(got) == 8
    assert None not in tree.match(pinned).pages and len(tree.match(pinned).pages) == 8
    assert tree.match(loose).pages == []
    assert tree.alloc_up_to(1) == []
    tree.free(got)
    tree.unlock(lock)
    tree.check_integrity()


@pytest.mark.parametrize("policy,grows", [("fifo", False), ("filo", False), ("lru", True)])
def test_touch_queues_a_new_key_only_when_the_policy_reads_use(make_kit, policy, grows) -> None:
    kit = make_kit(num_pages=16, policy=policy)
    hashes = kit.chain([1, 2])
    kit.put(hashes)
    before = kit.tree._queue.num_entries
    for t in range(5):
        kit.clock.now = float(t + 1)
        kit.tree.touch(hashes, 2)
    assert (kit.tree._queue.num_entries > before) is grows
