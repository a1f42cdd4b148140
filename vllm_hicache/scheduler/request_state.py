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
    # The request's block table per KV cache group (one list per group; a
    # hybrid model's sliding-window group may hold vLLM's null block, or ids
    # vLLM freed since, at positions outside the window).
    group_block_ids: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed_tokens: int = 0
    # Blocks [0, num_planned) have been considered for a store.
    num_planned: int = 0

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
