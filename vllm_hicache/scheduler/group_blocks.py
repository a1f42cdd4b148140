"""Which of a request's block positions a page can hold, and the copies that
move a page, for every KV cache group (hybrid models; one group is the
trivial case).

Invariant: a page holds every attention group's KV of its block position,
so any run of pages is a hit every attention group can restore:

- attention groups hold a position while their block there is real (not
  vLLM's null block); a sliding window's blocks before the window are
  freed when vLLM schedules the step, so those positions are never stored;
- a Mamba group's state is valid at a position only when its block there
  holds the state of the prefix ending at that position's boundary once the
  step's forward has run (``holds_state``); a page is stored either way,
  its state part copied only where valid, and the scheduler records which
  (page_states.py).

For an external hit of N blocks vLLM gives a Mamba group only the block at
position N-1 (the others are null), so only the last page's state loads,
and a hit must end at a page whose state is valid (``PageStates.usable``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_hicache.common.jobs import BlockCopy, BlockPage, merge_copies
from vllm_hicache.connector.geometry import KVGeometry
from vllm_hicache.connector.vllm_compat import l1_block_holds, null_block_id
from vllm_hicache.scheduler.request_state import ReqState

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

# One request's block ids per KV cache group (vLLM's block tables).
GroupIds = Sequence[Sequence[int]]


class GroupBlocks:
    """Owned by the scheduler half; reads request state, mutates nothing."""

    def __init__(self, geom: KVGeometry) -> None:
        self.geom = geom
        self.block_size = geom.block_size
        self.sliding_windows = [g.sliding_window_tokens for g in geom.groups
                                if g.sliding_window_tokens]
        self.mamba_groups = geom.mamba_groups
        self.block_pool: BlockPool | None = None
        self.null_block_id = 0  # vLLM's null block, read from the pool once bound

    def bind(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.null_block_id = null_block_id(block_pool)

    @property
    def hybrid(self) -> bool:
        """More than one KV cache group: positions need the checks below."""
        return self.geom.num_groups > 1

    def pairs(self, group_ids: GroupIds, positions: Sequence[int], pages: Sequence[int],
              with_state: Sequence[bool] | None = None) -> list[BlockPage]:
        """The (block, page) pairs copying block positions ``positions`` to or
        from ``pages`` (in step): one group's block ids, or for hybrid models
        every group's block at each position as group block ids
        (geometry.group_block_id), except where a group holds the null block
        (nothing to copy) and, given ``with_state`` (per position), a Mamba
        group's block where its state is not valid."""
        if len(group_ids) == 1:
            ids = group_ids[0]
            return [BlockPage(ids[i], page) for i, page in zip(positions, pages)]
        pairs = []
        for group, ids in enumerate(group_ids):
            states = with_state if group in self.mamba_groups else None
            for k, (i, page) in enumerate(zip(positions, pages)):
                block = ids[i]
                if block != self.null_block_id and (states is None or states[k]):
                    pairs.append(BlockPage(self.geom.group_block_id(group, block), page))
        return pairs

    def load_copy(self, group_ids: GroupIds, start: int, pages: Sequence[int]) -> BlockCopy:
        """The copy of a hit loading ``pages`` into block positions ``start,
        start+1, ...``; one group's copy without building pairs (every
        request's hit goes through here)."""
        if len(group_ids) == 1:
            return BlockCopy(tuple(group_ids[0][start:start + len(pages)]), tuple(pages))
        return merge_copies(self.pairs(group_ids, range(start, start + len(pages)), pages))

    def first_intact_block(self, state: ReqState) -> int:
        """First block position whose KV every group still holds once this
        step's forward has run. vLLM freed the sliding-window blocks before
        ``num_computed_tokens - window + 1`` when it scheduled this step, and
        may hand them to others in this very forward."""
        first = 0
        for window in self.sliding_windows:
            skipped_tokens = max(0, state.num_computed_tokens - window + 1)
            first = max(first, skipped_tokens // self.block_size)
        return first

    def holds_attention(self, state: ReqState, block: int) -> bool:
        """Does every attention group hold a real block at this position?"""
        mamba = self.mamba_groups
        return all(block < len(ids) and ids[block] != self.null_block_id
                   for g, ids in enumerate(state.group_block_ids) if g not in mamba)

    def holds_states(self, state: ReqState, block: int, done_tokens: int) -> bool:
        """Will every Mamba group hold the state of the boundary after this
        position once this step's forward (ending at ``done_tokens``) has run?"""
        return all(self.holds_state(state, g, block, done_tokens) for g in self.mamba_groups)

    def holds_state(self, state: ReqState, group: int, block: int, done_tokens: int) -> bool:
        """Does Mamba group ``group``'s block at position ``block`` hold the
        state of the prefix ending at that block's boundary once this step's
        forward has run? In vLLM's ``align`` mode the forward writes a
        request's state into its block at position ``(done_tokens - 1) //
        block_size``, a block this step's table names (vLLM nulls only older
        positions), so a forward ending exactly on the boundary leaves that
        state there. Elsewhere, only a block vLLM itself keys by this
        prefix's hash holds it (a prefill checkpoint it retains): our copy of
        the table may name a block vLLM freed and handed on, which has lost
        that hash."""
        ids = state.group_block_ids[group]
        if block >= len(ids) or ids[block] == self.null_block_id:
            return False
        num_tokens = (block + 1) * self.block_size
        if done_tokens == num_tokens:
            return True
        return self.block_pool is not None and l1_block_holds(
            self.block_pool, state.group_block_ids[group][block],
            state.request.block_hashes[block], group, num_tokens)
