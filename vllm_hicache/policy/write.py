"""Write policies: which computed blocks the scheduler half copies L1 -> L2.

- write_through: every computed full block, as soon as it is computed.
- write_through_selective: a block once it has been hit at least twice
  (computed once and reused once, counted per request that uses it).
- write_back: nothing on compute; a block is copied only when vLLM is about
  to evict it from L1 (see scheduler/write_back.py).

Hit counts for blocks not yet in L2 live in a bounded LRU table, so a long run
cannot grow it without limit. Pure module: no torch, no vllm.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from enum import StrEnum


class WritePolicyName(StrEnum):
    """hicache_write_policy's values (a str: compares and prints as its name)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


WRITE_POLICIES = tuple(WritePolicyName)
# Uses a block needs under write_through_selective before it is stored.
SELECTIVE_WRITE_HITS = 2
# Blocks the hit counter remembers, per L2 page (the engine and the
# capacity planner's replay size it alike).
HIT_COUNTER_SLOTS_PER_PAGE = 4


def hit_counter_slots(l2_pages: int) -> int:
    """The hit counter's capacity for an L2 of ``l2_pages`` pages."""
    return HIT_COUNTER_SLOTS_PER_PAGE * max(1, l2_pages)


class HitCounter:
    """Bounded LRU map block hash -> number of requests that used the block."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0, capacity
        self.capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def record(self, hashes: Iterable[bytes]) -> None:
        counts = self._counts
        for h in hashes:
            counts[h] = counts.pop(h, 0) + 1
        while len(counts) > self.capacity:
            counts.popitem(last=False)

    def count(self, block_hash: bytes) -> int:
        return self._counts.get(block_hash, 0)

    def clear(self) -> None:
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)


class WritePolicy:
    """Decides, per computed block, whether to store it now.

    The scheduler half calls ``record_use`` once per request for the blocks it
    uses, and ``should_store`` (or ``select``) for newly computed full blocks.
    """

    def __init__(self, name: str, counter_capacity: int) -> None:
        if name not in WRITE_POLICIES:
            raise ValueError(
                f"unknown hicache_write_policy {name!r}; accepted: {', '.join(WRITE_POLICIES)}"
            )
        self.name = name
        self.threshold = (SELECTIVE_WRITE_HITS if name == WritePolicyName.WRITE_THROUGH_SELECTIVE
                          else 1)
        self._counter = HitCounter(counter_capacity) if self.threshold > 1 else None

    @property
    def stores_on_compute(self) -> bool:
        return self.name != WritePolicyName.WRITE_BACK

    def record_use(self, hashes: Iterable[bytes]) -> None:
        if self._counter is not None:
            self._counter.record(hashes)

    def should_store(self, block_hash: bytes) -> bool:
        if self._counter is None:
            return self.stores_on_compute
        return self._counter.count(block_hash) >= self.threshold

    def select(self, hashes: Sequence[bytes], positions: list[int]) -> list[int]:
        """The ``positions`` (indices into ``hashes``) to store now: every
        block's ``should_store`` at once (write_through: no per-block call)."""
        if self._counter is None:
            return positions if self.stores_on_compute else []
        count, threshold = self._counter.count, self.threshold
        return [i for i in positions if count(hashes[i]) >= threshold]

    def clear(self) -> None:
        if self._counter is not None:
            self._counter.clear()
