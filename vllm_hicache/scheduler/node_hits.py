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
request the tier holds starts no L3 lookup (``NodeAdmission.serves_arrival``:
its lookup would only probe the same index again, on the lookup thread
beside the step that loads the hit; measured, the hand-off and that
thread's share of the GIL cost a cross-instance hit more than the probe).
The probe's answer serves the schedule pass right after the arrival, a
later pass asks again, and a request the tier no longer serves then is
looked up in L3 there (by the scheduler).

A request is offered a node-tier hit at most ``MAX_NODE_ADMISSIONS``
times. vLLM asks again for a request it preempted, and also for one whose
async load failed from its first block (it recomputes from there, as a new
request). A load that fails because the tier's page is gone or bad drops the
page, so the next probe misses; but where the halves disagree for good (a
rank whose reads of the tier fail, while the scheduler's lookups succeed),
the same hit would be offered and fail step after step.

Only where every rank can read the slots in place (storage/node_direct.py's
``config_blocker``: no head slices, no state pages, no encryption, a
page-major layout) and the model has one KV cache group. Nothing is pinned
here: a page evicted before the workers load it is a load error for its
block and the ones after, which vLLM recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_hicache.common.jobs import NodeLoadJob
from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.keys import KeyNamespace, loadable_block_limit
from vllm_hicache.node import NodeTierError
from vllm_hicache.scheduler import hit_tiers
from vllm_hicache.scheduler.load_gate import TIER_NODE, LoadGate
from vllm_hicache.scheduler.request_state import HitTokens, Lookup, NodeProbe, ReqState
from vllm_hicache.storage.base import StorageBackend
from vllm_hicache.storage.node_chain import NodeChainBackend, node_key
from vllm_hicache.storage.node_direct import config_blocker

if TYPE_CHECKING:
    from vllm_hicache.l3.planner import L3Planner

logger = logging.getLogger(__name__)

# Times one request is offered a node-tier hit (module doc): a preemption's
# second chance, not a loop.
MAX_NODE_ADMISSIONS = 2


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


class NodeAdmission:
    """The scheduler half's node-tier direct hits: the arrival's probe, the
    hit offered to vLLM, and its admission as a ``NodeLoadJob``.

    Called from the scheduler's hooks, on vLLM's scheduling thread only,
    with the current L3 planner (None: no L3, so no node tier). Mutates the
    ``ReqState`` it is given (``node_probe``, ``lookup``,
    ``declined_blocks``, ``hit_tokens_by_tier``, ``num_planned``,
    ``node_admissions``), the stats
    passed to ``admit``, and the planner's per-request prefetch (``forget``).
    """

    def __init__(self, block_size: int, load_gate: LoadGate, mem_layout: str,
                 page_states: bool, hybrid: bool) -> None:
        self.block_size = block_size
        self._gate = load_gate
        self._mem_layout = mem_layout
        self._page_states = page_states
        self._hybrid = hybrid
        # NodeHits of the planner last seen (attached, replaced or detached since).
        self._hits: tuple[object, NodeHits | None] = (None, None)
        self._warned_readmission = False

    def hits(self, planner: L3Planner | None) -> NodeHits | None:
        """The direct-hit lookups behind ``planner``; None where hits stay on
        the L2 path (no node tier, or a configuration it cannot load in place)."""
        if planner is None:
            return None
        if self._hits[0] is not planner:
            self._hits = (planner, node_hits_for(
                planner.backend, planner.namespaces, self._mem_layout, planner.cfg.encrypt,
                self._page_states, self._hybrid))
        return self._hits[1]

    def serves_arrival(self, planner: L3Planner | None, state: ReqState,
                       chain: Sequence[bytes], resident: int, step: int) -> bool:
        """Will the direct path serve this request, arriving before ``step``
        with ``resident`` blocks of ``chain`` in L1? Its probe then stands in
        for the L3 lookup (module docstring, "When")."""
        hits = self.hits(planner)
        if hits is None or not state.controls.loads_l2:
            return False
        end = self._capped(state, resident, len(chain))
        if resident >= end:
            return False
        found = hits.prefix(chain[resident:end])
        if found:
            state.node_probe = NodeProbe(step, resident, found)
        return found > 0

    def hit(self, planner: L3Planner | None, state: ReqState, num_computed_tokens: int,
            step: int) -> int | None:
        """Tokens of a node-tier hit after ``num_computed_tokens`` for a
        request with no L2 hit there; 0 when the load gate declined it; None
        when the tier holds none (or the request loads nothing)."""
        hits = self.hits(planner)
        if hits is None or not state.controls.loads_l2:
            return None
        if state.node_admissions >= MAX_NODE_ADMISSIONS:
            if not self._warned_readmission:
                self._warned_readmission = True
                logger.warning(
                    "HiCache node tier: request %s was offered a node-tier hit %d times and "
                    "is computed instead; its loads did not land (a worker that cannot read "
                    "the tier the scheduler finds pages in?); logged once",
                    state.request.request_id, state.node_admissions)
            return None
        start = num_computed_tokens // self.block_size
        end = self._capped(state, start,
                           loadable_block_limit(state.request.num_tokens, self.block_size))
        found = self._prefix(hits, state, start, end, step)
        if not found:
            return None
        state.lookup, state.declined_blocks = gated_lookup(
            self._gate, num_computed_tokens, found, self.block_size)
        assert planner is not None
        planner.forget(state.request.request_id)  # not staged through L2 as well
        return state.lookup.node_blocks * self.block_size

    def _capped(self, state: ReqState, start: int, end: int) -> int:
        """``end``, cut to the request's load cap of blocks after ``start``."""
        cap = state.controls.load_block_cap(self.block_size)
        return end if cap is None else min(end, start + cap)

    @staticmethod
    def _prefix(hits: NodeHits, state: ReqState, start: int, end: int, step: int) -> int:
        """Blocks [start, ...) the node tier holds, at most ``end - start``:
        the arrival's probe when this is the pass right after it (the tier
        may have changed since: a page gone by the load is a load error,
        recomputed), else a fresh lookup."""
        probe, state.node_probe = state.node_probe, None
        if probe is not None and probe.step == step and probe.start == start:
            return min(probe.found, end - start)
        return hits.prefix(state.request.block_hashes[start:end]) if end > start else 0

    def admit(self, state: ReqState, block_ids: Sequence[int], start: int, end: int,
              in_step: bool, stats: HiCacheStats) -> NodeLoadJob:
        """The load of blocks [start, end) into their L1 ``block_ids`` from
        the node tier: counted as L3 hits, no L2 page or op (a failure is a
        load error)."""
        request = state.request
        state.node_admissions += 1
        stats.record_load(end - start)
        num_tokens = (end - start) * self.block_size
        hit_tiers.record(stats, state, HitTokens(0, num_tokens), node_tokens=num_tokens)
        # The machine holds them once, in the tier: not stored to L2 again
        # (a failed load lowers num_computed_tokens, and they are reconsidered).
        state.num_planned = max(state.num_planned, end)
        return NodeLoadJob(request.request_id, tuple(request.block_hashes[start:end]),
                           tuple(block_ids), in_step=in_step)
