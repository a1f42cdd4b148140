"""A request's arrival in the scheduler half: its kv_transfer_params read
once, and its L3 lookup started, or deferred while the node tier's probe
stands in for it.

Rules:
- A request has at most one L3 lookup started by its arrival. It is cut to
  the request's load cap and starts after the blocks already resident (L1's
  leading run, and what L2 holds after it), so the lookup thread never asks
  the store about blocks no load would take from it.
- A request the node tier serves at arrival starts no lookup
  (node_hits.py, "When"); if the tier does not serve it when vLLM first has
  room for it, the lookup starts then, against the planner attached at that
  moment. With none attached (the admin API detached L3 in between), there
  is nothing to look up: the request is a miss.
- Bad kv_transfer_params never fail the engine: the request runs without
  HiCache, and the reason goes back in its output (``hicache_error``) and
  the log, at most once a minute.

Called from the scheduler half's hooks, on vLLM's scheduling thread only;
mutates the ``ReqState`` it is given (``controls``, ``param_error``,
``l3_lookup_deferred``, ``node_probe``) and the stats' parameter errors.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.connector.vllm_compat import l1_has_block
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import loadable_block_limit
from vllm_hicache.scheduler.node_hits import NodeAdmission
from vllm_hicache.scheduler.request_params import (
    DEFAULT_CONTROLS,
    NO_HICACHE,
    RequestControls,
    parse_request_params,
)
from vllm_hicache.scheduler.request_state import ReqState

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

    from vllm_hicache.l3.planner import L3Planner

logger = logging.getLogger(__name__)

# Warnings about rejected kv_transfer_params, at most one per this many seconds.
PARAM_WARN_INTERVAL_S = 60.0


class Arrivals:
    """What the scheduler half does as a request arrives (module doc)."""

    def __init__(self, tree: HiRadixTree, node_hits: NodeAdmission, stats: HiCacheStats,
                 block_size: int) -> None:
        self._tree = tree
        self._node_hits = node_hits
        self._stats = stats
        self._block_size = block_size
        self._block_pool: BlockPool | None = None
        self._param_warned_at = -PARAM_WARN_INTERVAL_S

    def bind(self, block_pool: BlockPool) -> None:
        """vLLM's block pool, for what L1 holds (before the first request)."""
        self._block_pool = block_pool

    def arrive(self, state: ReqState, planner: L3Planner | None, step: int) -> None:
        """Read the request's controls; start its L3 lookup with ``planner``
        (None: no L3, or an instance that serves no hits), or defer it when
        the node tier serves the request (its probe recorded for ``step``)."""
        request = state.request
        controls = state.controls = self._read_controls(request, state)
        if planner is None or not controls.looks_up_l3:
            return
        chain = self._chain(request)
        resident, in_l2 = self._resident_blocks(chain)
        if not in_l2 and self._node_hits.serves_arrival(planner, state, chain, resident, step):
            state.l3_lookup_deferred = True
            return
        self._start_lookup(planner, state, chain, resident)

    def start_deferred(self, state: ReqState | None, planner: L3Planner | None) -> None:
        """A request whose arrival probe stood in for its L3 lookup, and that
        the node tier does not serve after all: look it up now, if an L3 is
        still attached."""
        if state is None or not state.l3_lookup_deferred:
            return
        state.l3_lookup_deferred = False
        state.node_probe = None
        if planner is None:
            return
        chain = self._chain(state.request)
        self._start_lookup(planner, state, chain, self._resident_blocks(chain)[0])

    def _chain(self, request: Request) -> tuple[bytes, ...]:
        """The request's blocks a load may fill (never its last token's)."""
        return tuple(request.block_hashes[:loadable_block_limit(request.num_tokens,
                                                                self._block_size)])

    def _start_lookup(self, planner: L3Planner, state: ReqState, chain: tuple[bytes, ...],
                      resident: int) -> None:
        """The L3 lookup of the request's ``chain`` past its ``resident`` blocks."""
        cap = state.controls.load_block_cap(self._block_size)
        if cap is not None:
            chain = chain[: resident + cap]
        planner.start_lookup(state.request.request_id, chain, resident)

    def _read_controls(self, request: Request, state: ReqState) -> RequestControls:
        """The request's kv_transfer_params controls; NO_HICACHE, with the
        reason in ``state.param_error``, when they are bad."""
        params = request.kv_transfer_params
        if not params:
            return DEFAULT_CONTROLS
        try:
            return parse_request_params(params)
        except ValueError as exc:
            self._stats.record_param_error()
            state.param_error = str(exc)
            now = time.monotonic()
            if now - self._param_warned_at >= PARAM_WARN_INTERVAL_S:
                self._param_warned_at = now
                logger.warning("HiCache: request %s served without HiCache: %s "
                               "(%d such requests so far; logged at most once a minute)",
                               request.request_id, exc, self._stats.request_param_errors)
            return NO_HICACHE

    def _resident_blocks(self, chain: tuple[bytes, ...]) -> tuple[int, bool]:
        """Leading blocks already in vLLM's own cache (L1) or in L2, and
        whether L2 holds the block after L1's leading run (an L2 hit)."""
        pages = self._tree.match(chain).pages
        pool = self._block_pool

        def in_l1(i: int) -> bool:
            return pool is not None and l1_has_block(pool, chain[i])

        i = 0
        while i < len(chain) and in_l1(i):
            i += 1
        l1_run = i
        while i < len(chain) and ((i < len(pages) and pages[i] is not None) or in_l1(i)):
            i += 1
        return i, i > l1_run
