"""HiRadixTree.hot_nodes / node_chain: what a runtime L3 attach backs up
(admin/clear.py), in which order, under which hashes."""

from __future__ import annotations


def test_hottest_first_prefix_before_extensions(kit) -> None:
    shared = kit.chain([1, 2])
    cold = kit.chain([1, 2, 3])
    hot = kit.chain([1, 2, 4, 5])
    kit.put(cold)  # at t=0: splits off the shared [1, 2] node later
    kit.clock.now = 1.0
    kit.put(hot, [False, False, True, True])  # [1, 2] is in L2 already
    kit.clock.now = 2.0
    kit.tree.touch(hot, len(hot))
    nodes = kit.tree.hot_nodes()
    chains = [kit.tree.node_chain(node)[0] for node in nodes]
    # The shared prefix is as hot as its hottest extension, and comes first.
    assert chains == [shared, hot, cold]
    for node in nodes:
        chain, pages = kit.tree.node_chain(node)
        assert kit.tree.match(chain).pages == pages  # the hashes a lookup uses


def test_node_chain_of_a_gone_node_is_none(kit) -> None:
    a, b = kit.chain([1, 2, 3]), kit.chain([7, 8])
    kit.put(a)
    kit.put(b)
    nodes = kit.tree.hot_nodes()
    kit.tree.invalidate(a, 1)
    kit.tree.clear()
    assert all(kit.tree.node_chain(node) is None for node in nodes)
    assert kit.tree.hot_nodes() == []


def test_placeholders_are_not_listed_but_are_in_chains(kit) -> None:
    chain = kit.chain([1, 2, 3, 4])
    kit.tree.insert(chain, [None, None] + kit.tree.alloc(2))
    [node] = kit.tree.hot_nodes()
    hashes, pages = kit.tree.node_chain(node)
    assert hashes == chain and pages[:2] == [None, None] and None not in pages[2:]
