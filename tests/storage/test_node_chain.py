"""The node tier as the nearest L3 store (storage/node_chain.py): the
backend conformance suite alone and with a file store behind it, then what
only a chain does: lookups and reads fall through to the remote store, a
remote hit is promoted, and each page is sent to the remote store once per
machine."""

from __future__ import annotations

import pytest

from tests.storage.conformance import (
    OBJECT_BYTES,
    BackendConformance,
    empty,
    keys,
    make,
    obj,
    same,
)
from vllm_hicache.storage import StorageContext, create_backend
from vllm_hicache.storage.node_chain import NodeChainBackend, node_key

MODULE = {"module_path": "tests.storage.node_chain_backend", "class_name": "NodeChainForTests"}
CTX = StorageContext("worker", 0, 1, OBJECT_BYTES)


class TestNodeOnlyConformance(BackendConformance):
    @pytest.fixture
    def spec(self, node_root):
        return ("dynamic", {**MODULE, "root": node_root})

    @pytest.fixture
    def backend(self, spec):
        b = make(spec)
        yield b
        b.close()


class TestNodeThenFileConformance(TestNodeOnlyConformance):
    @pytest.fixture
    def spec(self, node_root, tmp_path):
        return ("dynamic", {**MODULE, "root": node_root, "remote_path": str(tmp_path / "l3")})


@pytest.fixture
def pair(node_root, tmp_path):
    """Two instances of one machine (two members), each with the same
    remote file store behind the tier, and the remote store seen alone."""
    spec = ("dynamic", {**MODULE, "root": node_root, "remote_path": str(tmp_path / "l3")})
    a, b = make(spec), make(spec)
    remote = create_backend("file", {"path": str(tmp_path / "l3")}, CTX)
    yield a, b, remote
    for x in (a, b, remote):
        x.close()


def test_a_page_one_instance_stored_is_sent_to_the_remote_store_once(pair):
    a, b, remote = pair
    ks = keys(3)
    assert a.put(ks, [obj(i) for i in range(3)]) == [True] * 3
    assert remote.exists_prefix(ks) == 3
    remote.clear()  # so a second remote write would show
    assert b.put(ks, [obj(i) for i in range(3)]) == [True] * 3
    assert remote.exists_prefix(ks) == 0
    assert b.stats()["node_tier_remote_puts_skipped"] == 3


def test_lookups_and_reads_fall_through_and_a_remote_hit_is_promoted(pair):
    a, b, remote = pair
    ks = keys(3)
    a.put(ks[:1], [obj(0)])
    remote.put(ks[1:], [obj(1), obj(2)])
    assert b.exists_prefix(ks) == 3
    assert a.tier.lookup([node_key(k) for k in ks]) == 1
    targets = [empty() for _ in ks]
    assert b.get(ks, targets) == [True] * 3
    assert all(same(t, obj(i)) for i, t in enumerate(targets))
    stats = b.stats()
    assert (stats["node_tier_hits"], stats["node_tier_remote_hits"],
            stats["node_tier_promotions"]) == (1, 2, 2)
    # Promoted: the other instance now reads all three from the node tier.
    remote.clear()
    assert a.get(ks, [empty() for _ in ks]) == [True] * 3
    assert a.stats()["node_tier_hits"] == 3


def test_a_failed_remote_write_is_reported_not_stored(pair, monkeypatch):
    a, _, remote = pair
    monkeypatch.setattr(a.remote, "put", lambda ks, srcs: [False] * len(ks))
    ks = keys(2)
    assert a.put(ks, [obj(0), obj(1)]) == [False, False]
    assert remote.exists_prefix(ks) == 0


def test_a_full_tier_still_sends_to_the_remote_store(node_root, tmp_path):
    from vllm_hicache.node import NodeTier
    tier = NodeTier.join("tiny", "x", 64 * 1024, OBJECT_BYTES, root=node_root)
    remote = create_backend("file", {"path": str(tmp_path / "l3")}, CTX)
    chain = NodeChainBackend({}, CTX, tier=tier, remote=remote)
    try:
        slots = tier.stats().num_slots
        assert len(tier.reserve(slots).slots) == slots  # nothing more can be placed
        ks = keys(2)
        assert chain.put(ks, [obj(0), obj(1)]) == [True, True]
        assert remote.exists_prefix(ks) == 2
    finally:
        chain.close()


def test_stats_show_capacity_and_occupancy(node_root):
    spec = ("dynamic", {**MODULE, "root": node_root})
    b = make(spec)
    try:
        b.put(keys(2), [obj(0), obj(1)])
        stats = b.stats()
        assert stats["node_tier_capacity_bytes"] == 256 * OBJECT_BYTES
        assert stats["node_tier_occupancy_bytes"] == 2 * OBJECT_BYTES
        assert stats["node_tier_inserts"] == 2 and stats["node_tier_members"] == 1
    finally:
        b.close()


def test_options_and_a_missing_tier_are_refused():
    with pytest.raises(ValueError, match="takes no options"):
        NodeChainBackend({"path": "/x"}, CTX)
    with pytest.raises(ValueError, match="joined NodeTier"):
        NodeChainBackend({}, CTX)


def test_metrics_gauges_show_the_node_tier_and_the_remote_store_behind_it(node_root, tmp_path):
    from vllm_hicache.common.stats import key, l3_usage_gauges
    spec = ("dynamic", {**MODULE, "root": node_root, "remote_path": str(tmp_path / "l3")})
    b = make(spec)
    remote = create_backend("file", {"path": str(tmp_path / "l3"), "max_bytes": 1 << 20}, CTX)
    b.remote.close()
    b.remote = remote  # a file store with a capacity, so it has gauges too
    try:
        b.put(keys(2), [obj(0), obj(1)])
        gauges = l3_usage_gauges(b)
        assert gauges[key("node_tier_used_bytes")] == 2 * OBJECT_BYTES
        assert gauges[key("node_tier_capacity_bytes")] == 256 * OBJECT_BYTES
        assert gauges[key("node_tier_members")] == 1
        assert gauges[key("l3_capacity_bytes")] == 1 << 20
        assert gauges[key("l3_used_bytes")] > 0
    finally:
        b.close()


def test_the_admin_view_shows_the_tier_and_each_members_counters(node_root):
    from vllm_hicache.storage.node_chain import node_tier_status
    spec = ("dynamic", {**MODULE, "root": node_root})
    a, b = make(spec), make(spec)
    try:
        ks = keys(2)
        a.put(ks, [obj(0), obj(1)])
        b.get(ks + keys(1), [empty() for _ in range(3)])
        view = node_tier_status(b)
        assert view["used_bytes"] == 2 * OBJECT_BYTES and view["free_slots"] == view["slots"] - 2
        assert view["this_member"] == b.tier.member_id
        assert view["members"][a.tier.member_id]["inserts"] == 2
        assert view["members"][b.tier.member_id]["hits"] == 2
        assert view["members"][b.tier.member_id]["misses"] == 1
        assert node_tier_status(None) is None
    finally:
        a.close()
        b.close()


def test_tier_changes_name_what_this_process_sealed_promoted_and_evicted(node_root, tmp_path):
    """take_removed_keys: the remote store's removals, then this process's
    tier changes (node_keys.py), the last change per key, each taken once."""
    from vllm_hicache.node import NodeTier
    from vllm_hicache.storage.node_keys import EVICTED, PROMOTED, SEALED, split_tier_changes
    tier = NodeTier.join("small", "x", 6 * OBJECT_BYTES, OBJECT_BYTES, root=node_root)
    remote = create_backend("file", {"path": str(tmp_path / "l3"), "max_bytes":
                                      3 * OBJECT_BYTES}, CTX)
    chain = NodeChainBackend({}, CTX, tier=tier, remote=remote)
    try:
        n = tier.stats().num_slots
        ks = keys(n + 2)
        for i in range(n):  # one by one: the remote store evicts between batches
            assert chain.put(ks[i:i + 1], [obj(i)]) == [True]
        chain.put(ks[n:n + 1], [obj(n)])  # the tier is full: its oldest page goes
        removed, changes = split_tier_changes(chain.take_removed_keys())
        assert changes[EVICTED] == [node_key(ks[0])]
        assert changes[SEALED] == [node_key(k) for k in ks[1:n + 1]]  # ks[0]'s last: out
        assert removed, "the remote store's max_bytes evictions pass through"
        assert chain.take_removed_keys() == []  # taken once
        # A page read from the remote store is promoted (and evicts again).
        remote.put(ks[n + 1:], [obj(0)])
        assert chain.get(ks[n + 1:], [empty()]) == [True]
        _, changes = split_tier_changes(chain.take_removed_keys())
        assert changes[PROMOTED] == [node_key(ks[n + 1])] and len(changes[EVICTED]) == 1
        assert (chain.counts()["inserts"], chain.counts()["promotions"],
                chain.counts()["evictions"]) == (n + 1, 1, 2)
    finally:
        chain.close()


def test_a_lookup_says_how_much_of_its_prefix_the_node_tier_had(pair):
    a, _, remote = pair
    ks = keys(4)
    a.put(ks[:2], [obj(0), obj(1)])
    remote.put(ks[2:3], [obj(2)])
    assert a.exists_prefix_split(ks) == (2, 3)
    assert a.exists_prefix(ks) == 3


def test_a_process_tally_counts_every_change_even_of_one_page(node_root, tmp_path):
    """The page counters and the admin GET count from one tally of the
    backend's cumulative counts (common/node_counts.py): a page sealed,
    evicted and sealed again between two reports counts each time, where
    the tier changes' channel keeps only its last change."""
    from vllm_hicache.common.node_counts import NodeCountTally, NodeTierCounts
    from vllm_hicache.common.stats import key
    from vllm_hicache.node import NodeTier
    from vllm_hicache.storage.node_keys import EVICTED, SEALED, split_tier_changes
    tier = NodeTier.join("tally", "x", 4 * OBJECT_BYTES, OBJECT_BYTES, root=node_root)
    chain = NodeChainBackend({}, CTX, tier=tier)
    tally = NodeCountTally()
    try:
        n = tier.stats().num_slots
        ks = keys(n + 1)
        for i in range(n + 1):  # the last evicts ks[0]
            chain.put(ks[i:i + 1], [obj(i)])
        chain.put(ks[:1], [obj(0)])  # ks[0] again: evicts ks[1]
        tally.observe(chain)
        assert tally.totals == NodeTierCounts(stored_pages=n + 2, evicted_pages=2)
        assert tally.take_gained().samples() == {key("node_tier_stored_pages"): n + 2,
                                                 key("node_tier_evicted_pages"): 2}
        _, changes = split_tier_changes(chain.take_removed_keys())
        assert len(changes[SEALED]) + len(changes[EVICTED]) < n + 4  # ks[0] counted once
        tally.observe(chain)  # nothing new
        assert tally.take_gained() == NodeTierCounts()
        assert tally.totals == NodeTierCounts(stored_pages=n + 2, evicted_pages=2)
    finally:
        chain.close()
