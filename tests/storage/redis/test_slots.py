"""Hash slots, the CLUSTER SLOTS parser and the cluster options, without a server."""

from __future__ import annotations

import pytest

from vllm_hicache.storage.redis.cluster_options import node_url, seed_addresses
from vllm_hicache.storage.redis.config import RedisConfig
from vllm_hicache.storage.redis.slots import SLOTS, SlotMap, key_slot


@pytest.mark.parametrize("key, slot", [
    (b"123456789", 0x31C3 % SLOTS),  # the CRC16/XMODEM check value
    (b"", 0),
    (b"foo", 12182),
    (b"{user1000}.following", key_slot(b"user1000")),
    (b"foo{}{bar}", key_slot(b"foo{}{bar}")),  # empty tag: the whole key
    (b"foo{{bar}}zap", key_slot(b"{bar")),  # first "{" to the first "}" after it
    (b"foo{bar}{zap}", key_slot(b"bar")),
    (b"no-closing{brace", key_slot(b"no-closing{brace")),
])
def test_key_slot(key, slot):
    assert key_slot(key) == slot


def node(host: str, port: int) -> list:
    return [host.encode(), port, b"id-" + str(port).encode(), []]


def test_slot_map_from_cluster_slots():
    reply = [
        [0, 5460, node("10.0.0.1", 7000), node("10.0.0.4", 7003)],
        [5461, 10922, node("", 7001)],  # empty host: the node that answered
        [10923, 16000, node("10.0.0.3", 7002)],
    ]
    slots = SlotMap.from_cluster_slots(reply, ("10.0.0.9", 7009))
    assert slots.owner(0) == slots.owner(5460) == ("10.0.0.1", 7000)
    assert slots.owner(5461) == ("10.0.0.9", 7001)
    assert slots.owner(16001) is None and slots.unserved() == 16383 - 16000
    assert slots.masters() == [("10.0.0.1", 7000), ("10.0.0.3", 7002), ("10.0.0.9", 7001)]
    assert ("10.0.0.4", 7003) in slots.nodes
    assert slots.group([0, 16383, 5461, 1]) == {
        ("10.0.0.1", 7000): [0, 3], None: [1], ("10.0.0.9", 7001): [2]}
    moved = slots.moved({1: ("10.0.0.3", 7002)})
    assert moved.owner(1) == ("10.0.0.3", 7002) and slots.owner(1) == ("10.0.0.1", 7000)


@pytest.mark.parametrize("reply, match", [
    (b"ERR", "expected a list"),
    ([[0, 1]], "malformed slot range"),
    ([[5, 2, node("h", 1)]], "bad slot range"),
    ([[0, SLOTS, node("h", 1)]], "bad slot range"),
    ([[0, 1, [b"h", b"7000"]]], "malformed node"),
    ([[0, 1, [7, 7000]]], "malformed host"),
])
def test_malformed_cluster_slots_are_named(reply, match):
    with pytest.raises(ValueError, match=match):
        SlotMap.from_cluster_slots(reply, ("h", 1))


def test_unknown_endpoint_is_unserved():
    slots = SlotMap.from_cluster_slots([[0, 9, node("?", 7000)]], ("h", 1))
    assert slots.owner(0) is None and slots.masters() == []


@pytest.mark.parametrize("options, match", [
    ({"url": "redis://h:1", "cluster_nodes": ["h:2"]}, "cluster_nodes needs cluster: true"),
    ({"url": "unix:///tmp/r.sock", "cluster": True}, "redis:// or rediss://"),
    ({"url": "redis://h:1/2", "cluster": True}, "database 0"),
    ({"url": "redis://h:1", "cluster": True, "key_prefix": "{t}:"}, "key_prefix.*one node"),
    ({"url": "redis://h:1", "cluster": "yes"}, "cluster.*true or false"),
    ({"url": "redis://h:1", "cluster": True, "cluster_nodes": "h:2"}, "list of"),
    ({"url": "redis://h:1", "cluster": True, "cluster_nodes": ["h"]}, "'h' is not"),
    ({"url": "redis://h:1", "cluster": True, "cluster_nodes": ["h:99999"]}, "is not"),
    ({"url": "redis://h:1", "cluster": True, "cluster_nodes": ["u@h:2"]}, "is not"),
])
def test_cluster_options_that_make_no_sense_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        RedisConfig.from_options(options)


def test_cluster_seeds_and_node_urls():
    cfg = RedisConfig.from_options({
        "url": "rediss://alice@10.0.0.1:7000/0", "cluster": True, "password": "pw",
        "cluster_nodes": ["10.0.0.2:7001", "[::1]:7002", "10.0.0.1:7000"]})
    seeds = seed_addresses(cfg.url, cfg.cluster_nodes)
    assert seeds == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)]
    # The url's scheme (TLS) and user go to every node; never a password.
    assert node_url(cfg.url, ("10.0.0.5", 7005)) == "rediss://alice@10.0.0.5:7005/0"
    assert node_url(cfg.url, ("::1", 7002)) == "rediss://alice@[::1]:7002/0"
