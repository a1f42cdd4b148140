"""Policies: data-in, decision-out objects (eviction, write). Pure Python."""

from vllm_hicache.policy.eviction import (
    EVICTION_POLICIES,
    EvictableNode,
    EvictionPolicy,
    make_eviction_policy,
)

__all__ = [
    "EVICTION_POLICIES",
    "EvictableNode",
    "EvictionPolicy",
    "make_eviction_policy",
]
