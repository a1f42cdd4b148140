"""Eviction policies: the order in which unpinned L2 leaves leave the host pool.

Each policy is data-in, decision-out: ``priority(node)`` reads plain node
statistics and returns a sort key; the tree evicts the smallest key first.
Names and orders follow SGLang's ``--radix-eviction-policy``. Pure module: it
imports neither torch, vllm nor ``vllm_hicache.index`` (nodes are described
by the ``EvictableNode`` protocol below).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Protocol

if sys.version_info >= (3, 12):
    from typing import override
else:
    from typing_extensions import override

# A policy's sort key: compared with ``<`` only, lower is evicted first.
SortKey = float | tuple[float, ...]


class EvictableNode(Protocol):
    """The node statistics a policy may read (kept by the radix tree)."""

    # clock() at the last match-and-use (touch) or insert through the node.
    last_access_time: float
    # clock() when the node's pages entered L2.
    creation_time: float
    # Number of requests that hit the node after it was created.
    hit_count: int
    # Max priority of the requests that inserted or touched the node.
    priority: int


class EvictionPolicy(ABC):
    """Orders evictable leaves. Called by ``HiRadixTree.evict`` (and ``alloc``).

    ``priority`` must not mutate the node; it is called once per evictable
    leaf per eviction round, so it should be a cheap attribute read.
    """

    # Does the key change when a node is used (``touch``)? If not, the tree
    # does not re-offer a touched leaf: its queued key is still right.
    keyed_by_use: bool = True

    @abstractmethod
    def priority(self, node: EvictableNode) -> SortKey:
        """Sort key of ``node``: the leaf with the smallest key goes first."""


class LRUPolicy(EvictionPolicy):
    @override
    def priority(self, node: EvictableNode) -> SortKey:
        return node.last_access_time


class LFUPolicy(EvictionPolicy):
    @override
    def priority(self, node: EvictableNode) -> SortKey:
        # Recency breaks ties between equally popular leaves.
        return (node.hit_count, node.last_access_time)


class FIFOPolicy(EvictionPolicy):
    keyed_by_use = False

    @override
    def priority(self, node: EvictableNode) -> SortKey:
        return node.creation_time


class MRUPolicy(EvictionPolicy):
    @override
    def priority(self, node: EvictableNode) -> SortKey:
        return -node.last_access_time


class FILOPolicy(EvictionPolicy):
    keyed_by_use = False

    @override
    def priority(self, node: EvictableNode) -> SortKey:
        return -node.creation_time


class PriorityPolicy(EvictionPolicy):
    @override
    def priority(self, node: EvictableNode) -> SortKey:
        # Low-priority requests' pages go first; LRU among equals.
        return (node.priority, node.last_access_time)


class EvictionPolicyName(StrEnum):
    """radix_eviction_policy's values, in the order error messages list them
    (a str: compares and prints as its name)."""

    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    MRU = "mru"
    FILO = "filo"
    PRIORITY = "priority"


_REGISTRY: dict[str, type[EvictionPolicy]] = {
    EvictionPolicyName.LRU: LRUPolicy,
    EvictionPolicyName.LFU: LFUPolicy,
    EvictionPolicyName.FIFO: FIFOPolicy,
    EvictionPolicyName.MRU: MRUPolicy,
    EvictionPolicyName.FILO: FILOPolicy,
    EvictionPolicyName.PRIORITY: PriorityPolicy,
}

EVICTION_POLICIES: tuple[str, ...] = tuple(EvictionPolicyName)


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Build the policy named by ``radix_eviction_policy``."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(
            f"unknown radix_eviction_policy {name!r}; "
            f"accepted: {', '.join(EVICTION_POLICIES)}"
        )
    return cls()
