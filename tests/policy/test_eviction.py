"""Eviction policies: sort keys per SGLang's semantics, and the name registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hicache.policy import EVICTION_POLICIES, EvictionPolicy, make_eviction_policy


def node(*, access: float = 0.0, created: float = 0.0, hits: int = 0, priority: int = 0):
    return SimpleNamespace(
        last_access_time=access, creation_time=created, hit_count=hits, priority=priority
    )


def evict_order(policy_name: str, nodes: dict[str, SimpleNamespace]) -> list[str]:
    policy = make_eviction_policy(policy_name)
    return sorted(nodes, key=lambda name: policy.priority(nodes[name]))


# x: oldest, most recently used, middle popularity, middle priority
# y: middle age, least recently used, least popular, highest priority
# z: newest, middle recency, most popular, lowest priority
NODES = {
    "x": node(created=1, access=6, hits=2, priority=1),
    "y": node(created=2, access=4, hits=1, priority=2),
    "z": node(created=3, access=5, hits=3, priority=0),
}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("lru", ["y", "z", "x"]),
        ("lfu", ["y", "x", "z"]),
        ("fifo", ["x", "y", "z"]),
        ("mru", ["x", "z", "y"]),
        ("filo", ["z", "y", "x"]),
        ("priority", ["z", "x", "y"]),
    ],
)
def test_policy_order(name: str, expected: list[str]) -> None:
    assert evict_order(name, NODES) == expected


def test_lfu_breaks_ties_by_recency() -> None:
    nodes = {"old": node(hits=2, access=1), "new": node(hits=2, access=9)}
    assert evict_order("lfu", nodes) == ["old", "new"]


def test_priority_breaks_ties_by_recency() -> None:
    nodes = {"old": node(priority=3, access=1), "new": node(priority=3, access=9)}
    assert evict_order("priority", nodes) == ["old", "new"]


def test_priority_does_not_mutate_node() -> None:
    n = node(created=1, access=2, hits=3, priority=4)
    before = dict(vars(n))
    for name in EVICTION_POLICIES:
        make_eviction_policy(name).priority(n)
    assert vars(n) == before


def test_registry_lists_sglang_names() -> None:
    assert EVICTION_POLICIES == ("lru", "lfu", "fifo", "mru", "filo", "priority")
    for name in EVICTION_POLICIES:
        assert isinstance(make_eviction_policy(name), EvictionPolicy)


def test_unknown_policy_names_the_accepted_ones() -> None:
    expected = r"unknown radix_eviction_policy 'lru2'; accepted: lru, lfu, fifo"
    with pytest.raises(ValueError, match=expected):
        make_eviction_policy("lru2")


def test_config_accepts_exactly_the_registered_names() -> None:
    # config.py keeps its own copy so that parsing never imports policy code.
    from vllm_hicache import config

    assert tuple(config.EVICTION_POLICIES) == EVICTION_POLICIES
