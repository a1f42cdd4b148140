"""The node tier's page keys and the worker's tier-change strings
(storage/node_keys.py): an object key's page can be named back from its
node key, keys of different forms or tags never meet, and tier changes
ride the removal channel without being taken for removals."""

from __future__ import annotations

from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage.node_keys import (
    EVICTED,
    PROMOTED,
    SEALED,
    ObjectKeyNames,
    node_key,
    split_tier_changes,
    tier_changes,
)

HASHES = [bytes([3, i]) * 16 for i in range(3)]


def ns(rank: int, **kw) -> KeyNamespace:
    return KeyNamespace("m", "float32", "layer_first", 16, tp_size=2, tp_rank=rank, **kw)


def test_a_node_key_fits_the_tier_and_names_its_object_back():
    names = ObjectKeyNames([ns(0).tag, ns(1).tag])
    for rank in (0, 1):
        for key in ns(rank).object_keys(HASHES):
            nk = node_key(key)
            assert len(nk) <= 64
            assert names.object_key(nk) == key


def test_keys_of_other_tags_or_unnameable_keys_are_not_named():
    names = ObjectKeyNames([ns(0).tag])
    other = node_key(ns(1).object_keys(HASHES[:1])[0])
    assert names.object_key(other) is None  # a shard this engine was not told of
    for odd in ("no-dash-but-not-hex-zz", "nodash", "t-" + "ab" * 60):
        nk = node_key(odd)
        assert len(nk) == 33 and names.object_key(nk) is None
    assert names.object_key(b"") is None and names.object_key(b"N") is None


def test_distinct_object_keys_get_distinct_node_keys():
    keys = ns(0).object_keys(HASHES) + ns(1).object_keys(HASHES)
    keys += [ns(0, name_key=b"s" * 32, protection="gmac:t").object_keys(HASHES[:1])[0]]
    keys += ["odd-zz", "odd-zy", "x-0000", "y-0000"]
    assert len({node_key(k) for k in keys}) == len(keys)


def test_tier_changes_ride_the_removal_channel_and_come_back_out():
    a, b, c = (node_key(k) for k in ns(0).object_keys(HASHES))
    removal = ns(0).object_keys(HASHES[:1])[0]
    channel = set(tier_changes({a: SEALED, b: PROMOTED, c: EVICTED})) | {removal, "node+zz"}
    removed, changes = split_tier_changes(channel)
    assert removed == [removal]  # an L3 removal stays one; a garbled change is dropped
    assert changes == {SEALED: [a], PROMOTED: [b], EVICTED: [c]}
