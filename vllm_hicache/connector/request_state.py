"""Per-request state of the scheduler half, kept in step with vLLM's
SchedulerOutput (block tables grow; a resumed request gets a new one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass(slots=True)
class ReqState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Blocks [0, num_planned) have been considered for a store.
    num_planned: int = 0


def track_scheduled(reqs: dict[str, ReqState], scheduler_output: SchedulerOutput) -> None:
    """Follow each request's block table and computed tokens from a step's output."""
    for new in scheduler_output.scheduled_new_reqs:
        state = reqs.get(new.req_id)
        if state is not None:
            state.block_ids = list(new.block_ids[0])
            state.num_computed_tokens = new.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        state = reqs.get(req_id)
        if state is None:
            continue
        new_ids = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids:
            state.block_ids = list(new_ids[0]) if new_ids else []
        elif new_ids:
            state.block_ids.extend(new_ids[0])
        state.num_computed_tokens = cached.num_computed_tokens[i]
