"""Which tier an admitted hit came from: L2, or the request's own L3
prefetch (and, of that, the node tier).

A hit of blocks [start, end) is split once, when vLLM admits the request:
the blocks its own prefetch brought into L2 count as L3, the rest as L2, and
a node-tier load into L1 (node_hits.py) counts whole as L3 and as node. The
split goes into ``HiCacheStats`` then and is kept on the request's record
until vLLM asks for it (``get_external_cache_hit_sources``), which it does
once per admission; a later ask, or one for a different token count, is
answered as an L2 hit, which is what vLLM's counters had before sources.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm_hicache.common.stats import HiCacheStats, overlap_blocks
from vllm_hicache.scheduler.request_state import HitTokens, ReqState

if TYPE_CHECKING:
    from vllm_hicache.l3.planner import L3Planner


def own_l3_blocks(l3: L3Planner | None, req_id: str, start: int, end: int) -> int:
    """How many blocks of [start, end) the request's own L3 prefetch put into L2."""
    return overlap_blocks(l3.prefetched_range(req_id) if l3 is not None else None, start, end)


def l3_hit_stages(l3: L3Planner | None, req_id: str, start: int,
                  end: int) -> dict[str, float] | None:
    """The wait of a request admitted now with blocks [start, end), per stage
    (l3/hit_stages.py), when its own L3 prefetch brought some of them; else None."""
    if l3 is None or not own_l3_blocks(l3, req_id, start, end):
        return None
    return l3.hit_stages(req_id, time.monotonic())


def record(stats: HiCacheStats, state: ReqState, tokens: HitTokens,
           node_tokens: int = 0) -> None:
    """Count an admitted hit's ``tokens`` (``node_tokens`` of its L3 part
    from the node tier) and keep them for vLLM's question."""
    stats.record_hit_tokens(tokens.l2, tokens.l3)
    stats.hit_tokens_node += node_tokens
    state.hit_tokens_by_tier = tokens


def record_l2_load(stats: HiCacheStats, l3: L3Planner | None, state: ReqState,
                   start: int, end: int, block_size: int) -> None:
    """Count a hit of blocks [start, end) loaded from L2, split into what
    was in L2 and what the request's own L3 prefetch brought in."""
    req_id = state.request.request_id
    l3_blocks = own_l3_blocks(l3, req_id, start, end)
    node_blocks = (overlap_blocks(l3.node_range(req_id), start, end)
                   if l3 is not None and l3_blocks else 0)
    record(stats, state, HitTokens((end - start - l3_blocks) * block_size,
                                   l3_blocks * block_size), node_blocks * block_size)


def take(state: ReqState | None, num_tokens: int) -> dict[str, int]:
    """``num_tokens`` of the request's last admitted hit, by tier (non-zero
    only); asked once per admission."""
    tokens = state.hit_tokens_by_tier if state is not None else None
    if state is not None:
        state.hit_tokens_by_tier = None
    if tokens is None or tokens.l2 + tokens.l3 != num_tokens:
        tokens = HitTokens(num_tokens, 0)
    return {tier: n for tier, n in (("L2", tokens.l2), ("L3", tokens.l3)) if n}
