"""Edge cases of the struct-of-arrays index (node.py, child_index.py,
eviction_queue.py): reused slots, the child table's deletions, hashes that
are not chained, the compact one-block form, and the eviction run."""

from __future__ import annotations

import random

import pytest

from vllm_hicache.index import HiRadixTree
from vllm_hicache.index.child_index import ChildIndex
from vllm_hicache.index.node import ROOT, NodeStore
from vllm_hicache.policy import make_eviction_policy
from vllm_hicache.policy.eviction import EvictionPolicy


def test_a_reused_slot_is_not_the_node_handed_out(kit) -> None:
    old = kit.chain([1])
    kit.put(old)
    [ref] = kit.tree.hot_nodes()
    assert kit.tree.evict(1) == 1
    new = kit.chain([2])
    kit.put(new)
    [new_ref] = kit.tree.hot_nodes()
    assert new_ref.node == ref.node  # the freed slot was taken again
    assert kit.tree.node_chain(ref) is None
    assert kit.tree.node_chain(new_ref)[0] == new


def test_child_index_agrees_with_a_dict_under_random_adds_and_removes() -> None:
    rng = random.Random(0)
    store = NodeStore(0.0)
    index = ChildIndex(store)
    model: dict[tuple[int, bytes], int] = {}
    live: list[int] = []
    for step in range(4000):
        if live and rng.random() < 0.45:
            node = live.pop(rng.randrange(len(live)))
            del model[(store.parent[node], store.first_hash(node))]
            index.remove(node)
            store.release(node)
        else:
            # Few parents and short hashes: many collisions and long clusters.
            parent = rng.choice([ROOT, *live[:3]])
            first = rng.randrange(1 << 16).to_bytes(2, "little")
            if (parent, first) in model:
                continue
            node = store.new(parent, [first], None, 0.0, 0)
            index.add(node)
            model[(parent, first)] = node
            live.append(node)
        if step % 97 == 0:
            assert len(index) == len(model)
            for (parent, first), node in model.items():
                assert index.find(parent, first) == node
            assert index.find(ROOT, b"none") == -1


def test_one_hash_under_two_parents_is_two_positions(kit) -> None:
    # Not chained (vLLM's are): the same hash follows two different blocks.
    a, b, x = b"a" * 8, b"b" * 8, b"x" * 8
    pa = kit.put([a, x])
    pb = kit.put([b, x])
    assert kit.tree.match([a, x]).pages == pa
    assert kit.tree.match([b, x]).pages == pb
    assert kit.tree.evict(1) == 1
    kit.tree.check_integrity()
    assert kit.tree.match([a, x]).pages == pa[:1]
    assert kit.tree.match([b, x]).pages == pb


def test_one_block_form_through_extend_trim_split_and_fill(kit) -> None:
    tree = kit.tree
    hashes = kit.chain([1, 2, 3, 4])
    tree.insert(hashes[:1], tree.alloc(1))  # one block: no list
    tree.check_integrity()
    tree.insert(hashes[:3], [None] + tree.alloc(2))  # the leaf grows into a run
    tree.check_integrity()
    assert kit.num_nodes() == 1
    assert tree.evict(2) == 2  # trimmed back to one block
    tree.check_integrity()
    tree.insert(hashes[:3], [None] + tree.alloc(2))  # grows again
    pages = tree.match(hashes[:3]).pages
    kit.put(kit.chain([1, 9]), [False, True])  # splits the run: one-block head, two-block tail
    assert kit.num_nodes() == 3
    assert tree.match(hashes[:3]).pages[1:] == pages[1:]
    tree.insert(hashes, [None] * 3 + tree.alloc(1))
    tree.check_integrity()
    # A placeholder head, filled later: one-block and multi-block fills.
    other = kit.chain([5, 6, 7])
    tree.insert(other, [None, None] + tree.alloc(1))
    tree.insert(other, tree.alloc(2) + [None])
    tree.check_integrity()
    assert None not in tree.match(other).pages


@pytest.mark.parametrize("policy", ["lru", "fifo", "mru", "filo", "lfu", "priority"])
def test_many_one_block_leaves_compact_the_run_and_keep_the_order(policy) -> None:
    """Thousands of pops from the sorted run (its head is compacted), with
    touches that send keys to the heap; every eviction is the leaf a full
    sort would pick."""
    clock = [0.0]
    evicted: list[bytes] = []
    tree = HiRadixTree(64, make_eviction_policy(policy), lambda: clock[0],
                       on_evict=evicted.extend)
    rng = random.Random(1)
    queue, store = tree._queue, tree._nodes
    live: list[bytes] = []
    for i in range(3000):
        clock[0] += 1.0
        if rng.random() < 0.2 and live:
            tree.touch([rng.choice(live)], 1, priority=rng.randrange(3))
        expected = None
        if tree.num_free_pages == 0:  # this alloc evicts: the leaf a full sort puts first
            first = min(queue, key=lambda n: (queue.key(n), store.serial[n]))
            expected = [store.first_hash(first)]
        pages = tree.alloc(1)
        assert pages is not None
        assert (evicted or None) == expected
        for gone in evicted:
            live.remove(gone)
        evicted.clear()
        key = i.to_bytes(4, "little")
        tree.insert([key], pages, priority=rng.randrange(3))
        live.append(key)
        if i % 250 == 0:
            tree.check_integrity()
    tree.check_integrity()
    assert tree.num_cached_pages == 64


class _ThreeNumbers(EvictionPolicy):
    def priority(self, node):  # noqa: ANN001, ANN201
        return (node.hit_count, node.priority, node.last_access_time)


def test_a_policy_key_of_three_numbers_is_refused() -> None:
    tree = HiRadixTree(4, _ThreeNumbers())
    with pytest.raises(TypeError, match="at most two"):
        tree.insert([b"k"], tree.alloc(1))


def test_a_free_slot_has_no_blocks() -> None:
    store = NodeStore(0.0)
    node = store.new(ROOT, [b"a", b"b"], None, 0.0, 0)
    assert (store.blocks(node), store.first_hash(node), store.num_blocks(node)) == (
        [b"a", b"b"], b"a", 2)
    store.release(node)
    for read in (store.blocks, store.first_hash):
        with pytest.raises(KeyError, match=f"node {node} is a free slot"):
            read(node)
