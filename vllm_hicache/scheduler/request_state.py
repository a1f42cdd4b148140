"""The scheduler half's one record per request, and how it follows vLLM.

Invariant: everything the scheduler half knows about a request lives in its
``ReqState``, in ``HiCacheScheduler._reqs``; the record is made by
``HiCacheScheduler._record`` (from ``on_new_request``, which vLLM calls
before any lookup, or from the lookup should one come first) and dropped only
by ``request_finished`` (which vLLM calls for every request it was given,
finished or aborted, running or waiting). Some fields
live shorter than the record: a lookup waits for ``update_state_after_alloc``,
a hit's split by tier for vLLM's question about it. What outlives a request
is kept by the operation it started, never here: an async load in flight
(inflight.py) keeps its pins after an abort until the workers report it.

The block tables follow vLLM's SchedulerOutput (``track_scheduled``): they
grow step by step, and a resumed request gets a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from vllm_hicache.scheduler.request_params import DEFAULT_CONTROLS, RequestControls

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class HitTokens(NamedTuple):
    """Tokens of one admitted hit, by the tier that held them (hit_tiers.py)."""

    l2: int
    l3: int


class NodeProbe(NamedTuple):
    """The node tier held ``found`` blocks of a request from block
    ``start`` on, when it arrived before scheduler step ``step``."""

    step: int
    start: int
    found: int


class Lookup(NamedTuple):
    """A request's last lookup: vLLM's own hit, and the L2 pages after it
    (and the pages an L3 read fills this step after those), or (no L2 page)
    the node-tier blocks loaded directly after it. ``tier``: the load gate's
    name for the hit's tier (load_gate.py)."""

    num_computed_tokens: int
    pages: list[int]
    node_blocks: int = 0
    tier: str = "L2"
    # Pages of the request's same-step L3 prefetch offered behind the L2
    # pages (l3/same_step.py).
    l3_pages: tuple[int, ...] = ()


@dataclass(slots=True)
class ReqState:
    request: Request
    # The request's block table per KV cache group (one list per group; a
    # hybrid model's sliding-window group may hold vLLM's null block, or ids
    # vLLM freed since, at positions outside the window).
    group_block_ids: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed_tokens: int = 0
    # Blocks [0, num_planned) have been considered for a store.
    num_planned: int = 0
    # Its kv_transfer_params (request_params.py); NO_HICACHE when they were
    # rejected, for the reason in param_error (returned when it finishes).
    controls: RequestControls = DEFAULT_CONTROLS
    param_error: str | None = None
    # What get_num_new_matched_tokens found, for update_state_after_alloc
    # (vLLM may look a waiting request up several times: the last call wins;
    # None once used).
    lookup: Lookup | None = None
    # L2 (or node-tier) hit blocks the load gate declined at the last lookup
    # (vLLM recomputes them), counted when the request is admitted.
    declined_blocks: int = 0
    # What the node tier held when the request arrived (node_hits.py), for
    # its first schedule pass; set only when that probe stood in for its L3
    # lookup (``l3_lookup_deferred``: started if the node tier does not
    # serve it after all).
    node_probe: NodeProbe | None = None
    l3_lookup_deferred: bool = False
    # Times it was admitted with a node-tier hit (node_hits.py caps them).
    node_admissions: int = 0
    # (L2, L3) tokens of the hit just admitted, until vLLM asks for them
    # (get_external_cache_hit_sources); None when not loaded or asked already.
    hit_tokens_by_tier: HitTokens | None = None

    @property
    def block_ids(self) -> list[int]:
        """The first group's block table (every group has one per block)."""
        return self.group_block_ids[0]


def track_scheduled(reqs: dict[str, ReqState], scheduler_output: SchedulerOutput) -> None:
    """Follow each request's block tables and computed tokens from a step's output."""
    for new in scheduler_output.scheduled_new_reqs:
        state = reqs.get(new.req_id)
        if state is not None:
            state.group_block_ids = [list(ids) for ids in new.block_ids] or [[]]
            state.num_computed_tokens = new.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        state = reqs.get(req_id)
        if state is None:
            continue
        new_ids = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids:
            state.group_block_ids = [list(ids) for ids in new_ids] if new_ids else [[]]
        elif new_ids:
            if len(state.group_block_ids) < len(new_ids):
                state.group_block_ids += [[] for _ in range(len(new_ids) - len(
                    state.group_block_ids))]
            for table, ids in zip(state.group_block_ids, new_ids):
                table.extend(ids)
        state.num_computed_tokens = cached.num_computed_tokens[i]
