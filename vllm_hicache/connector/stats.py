"""Counters of the scheduler half, in blocks (pages), since engine start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class HiCacheStats:
    # Blocks loaded L2 -> L1 (hits beyond vLLM's own prefix cache).
    loaded_blocks: int = 0
    # Requests that got at least one L2 block.
    load_requests: int = 0
    # Blocks copied L1 -> L2 (write-through and write-back).
    stored_blocks: int = 0
    # Blocks not stored because no page could be freed (all pinned).
    store_skipped_blocks: int = 0
    # L2 pages evicted to make room.
    evicted_pages: int = 0
    # Blocks the workers reported as failed loads (vLLM recomputes them).
    load_error_blocks: int = 0
    # Pages taken out of the index because a copy into or out of them failed.
    invalidated_pages: int = 0

    def record_load(self, num_blocks: int) -> None:
        self.loaded_blocks += num_blocks
        self.load_requests += 1

    def record_store(self, num_blocks: int) -> None:
        self.stored_blocks += num_blocks

    def record_store_skipped(self, num_blocks: int) -> None:
        self.store_skipped_blocks += num_blocks

    def record_evict(self, num_pages: int) -> None:
        self.evicted_pages += num_pages

    def record_load_errors(self, num_blocks: int) -> None:
        self.load_error_blocks += num_blocks

    def record_invalidated(self, num_pages: int) -> None:
        self.invalidated_pages += num_pages
