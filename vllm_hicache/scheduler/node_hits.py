"""Node-tier hits the workers load into L1 directly (l3/node_loads.py), as
the scheduler half sees them.

Rule: a request whose blocks after vLLM's own hit are not in this
instance's L2 at all asks the node tier how many of them it holds (a local
SQLite read, answered in the call: min over the ranks' object keys, as an
L3 lookup is). That prefix goes through the load gate (load_gate.py, tier
``node``) and is admitted as a load with no L2 page (``NodeLoadJob``):
loaded within the step, before the forward, when the connector loads
synchronously (``hicache_load_mode=layerwise``, as an L2 hit is), else as
an async load; the pages are not also staged into L2 by an L3 prefetch.
A hit the gate declines is recomputed, all of it (not staged either). A
request with an L2 hit keeps the L2 path (and the L3 path after it)
unchanged.

When: the scheduler half probes the node tier as a request arrives, and a
request the tier holds starts no L3 lookup (the scheduler's
``_node_tier_serves``; the probe's answer serves the schedule pass right
after the arrival, a later pass asks again, and a request the tier no
longer serves then is looked up in L3 there).

Only where every rank can read the slots in place (storage/node_direct.py's
``config_blocker``: no head slices, no state pages, no encryption, a
page-major layout) and the model has one KV cache group. Nothing is pinned
here: a page evicted before the workers load it is a load error for its
block and the ones after, which vLLM recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from vllm_hicache.keys import KeyNamespace
from vllm_hicache.node import NodeTierError
from vllm_hicache.scheduler.load_gate import TIER_NODE, LoadGate
from vllm_hicache.scheduler.request_state import Lookup
from vllm_hicache.storage.base import StorageBackend
from vllm_hicache.storage.node_chain import NodeChainBackend, node_key
from vllm_hicache.storage.node_direct import config_blocker

logger = logging.getLogger(__name__)


class NodeHits:
    """Lookups of the node tier behind one L3 planner's backend."""

    def __init__(self, backend: NodeChainBackend, namespaces: Sequence[KeyNamespace]) -> None:
        self.backend = backend
        self._namespaces = list(namespaces)

    def prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` every rank finds in the node tier."""
        hit = len(hashes)
        for ns in self._namespaces:
            if not hit:
                break
            keys = [node_key(k) for k in ns.object_keys(hashes[:hit])]
            try:
                hit = min(hit, self.backend.tier.lookup(keys))
            except NodeTierError as e:
                logger.warning("HiCache node tier lookup failed (%s): a miss", e)
                return 0
        return hit


def node_hits_for(backend: StorageBackend, namespaces: Sequence[KeyNamespace],
                  mem_layout: str, encrypted: bool, page_states: bool,
                  hybrid: bool) -> NodeHits | None:
    """NodeHits when ``backend`` has a node tier and its pages can be loaded
    in place on every rank; None otherwise (hits stay on the L2 path)."""
    if not isinstance(backend, NodeChainBackend) or not namespaces:
        return None
    per_page = max(len(ns.page_namespaces()) for ns in namespaces)
    blocker = config_blocker(mem_layout, per_page, page_states or hybrid, encrypted)
    if blocker is not None:
        logger.info("HiCache node tier: hits are staged through L2 (%s)", blocker)
        return None
    logger.info("HiCache node tier: hits load from the shared segment into L1 directly")
    return NodeHits(backend, namespaces)


def gated_lookup(gate: LoadGate, num_computed_tokens: int, found: int,
                 block_size: int) -> tuple[Lookup, int]:
    """The lookup a node-tier hit of ``found`` blocks after
    ``num_computed_tokens`` is admitted with, and how many blocks the load
    gate declined (all of them or none: vLLM then computes them)."""
    if gate.load_node(num_computed_tokens, found * block_size, found):
        return Lookup(num_computed_tokens, [], found, TIER_NODE), 0
    return Lookup(num_computed_tokens, [], 0, TIER_NODE), found
