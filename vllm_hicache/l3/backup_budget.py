"""The L3 write budget as the planner applies it to backups.

policy/write_budget.py holds the bucket (bytes per second with a burst,
bytes per day); this module turns it into blocks: what one block of backup
costs (all ranks' objects, headers included), how many blocks may go now,
and which blocks of a step's backups are skipped when they do not all fit:
the least valuable first (``block_value``: requests that used the block,
then shallower), so a chain keeps its prefix. Skipped blocks are counted by
the limit that skipped them; nothing waits. Owned by L3Planner, single-
threaded like it."""

from __future__ import annotations

from collections.abc import Callable

from vllm_hicache.common.page_ops import PinnedRange
from vllm_hicache.policy.write_budget import (
    REASON_BANDWIDTH,
    REASON_DAY,
    WriteBudget,
    WriteBudgetConfig,
    block_value,
    pick_within,
)


class BackupBudget:
    def __init__(self, config: WriteBudgetConfig, block_bytes: int) -> None:
        # One block's bytes in L3, all ranks' objects (headers included).
        self.block_bytes = block_bytes
        self.bucket = self._bucket(config)
        self.skipped = {REASON_BANDWIDTH: 0, REASON_DAY: 0}

    def _bucket(self, config: WriteBudgetConfig) -> WriteBudget:
        if config.enabled:
            config.check_block(self.block_bytes)
        return WriteBudget(config)

    def reconfigure(self, config: WriteBudgetConfig) -> None:
        """New limits (an admin re-configure); what was skipped stays counted."""
        self.bucket = self._bucket(config)

    @property
    def enabled(self) -> bool:
        return self.bucket.enabled

    def spend(self, num_blocks: int) -> None:
        """A backup of ``num_blocks`` blocks was opened."""
        if self.bucket.enabled:
            self.bucket.spend(num_blocks * self.block_bytes)

    def blocks_now(self) -> int | None:
        """Blocks a backup may write now; None: no budget."""
        if not self.bucket.enabled:
            return None
        room, _ = self.bucket.room()
        return int(room // max(1, self.block_bytes))

    def cut(self, ranges: list[PinnedRange],
            hits: Callable[[bytes], int]) -> list[PinnedRange]:
        """``ranges`` cut to what the budget allows now, the least valuable
        blocks skipped and counted; ``hits(block hash)``: its uses."""
        if not self.bucket.enabled or not ranges:
            return ranges
        room, reason = self.bucket.room()
        items = [(r, i) for r, rng in enumerate(ranges) for i in range(len(rng.blocks))]
        values = [block_value(hits(ranges[r].chain[ranges[r].blocks[i]]), ranges[r].blocks[i])
                  for r, i in items]
        keep = pick_within(values, self.block_bytes, room)
        if len(keep) == len(items):
            return ranges
        self.skipped[reason] += len(items) - len(keep)
        kept: dict[int, list[int]] = {}
        for n in sorted(keep):
            r, i = items[n]
            kept.setdefault(r, []).append(i)
        out = []
        for r, idx in sorted(kept.items()):
            rng = ranges[r]
            blocks = tuple(rng.blocks[i] for i in idx)
            out.append(PinnedRange(rng.chain[: blocks[-1] + 1], blocks,
                                   tuple(rng.pages[i] for i in idx)))
        return out
