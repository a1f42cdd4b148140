"""Write budgets: a cap on the bytes L2 -> L3 backups may write.

For SSD endurance and shared networks, an operator caps what HiCache writes
to L3 (``l3_write_budget_bytes_per_s`` with ``l3_write_burst_bytes``, and
``l3_write_budget_bytes_per_day``). The cap is enforced where backups are
planned (the scheduler half's L3 planner), never by waiting: a step's
backups that do not fit are *skipped*, not queued, so serving never slows
down and no backlog builds behind a budget that will never catch up. A
skipped block is only a later L3 miss.

- **Bandwidth** (token bucket): the budget refills at
  ``bytes_per_s`` up to ``burst_bytes`` (full at start); a write spends it.
  Over any interval of ``t`` seconds at most ``burst_bytes + bytes_per_s x t``
  bytes are planned.
- **Per day** (sliding window): at most ``bytes_per_day`` bytes in the last
  24 one-hour slots, the current one included, so over any 23 hours (and
  any 24 whole clock-hours of the window) at most ``bytes_per_day``.

Which blocks are skipped: the least valuable first (``block_value``:
requests that used the block, then the shallower the better: L3 lookups
are by prefix, so a deeper block without its prefix is worth nothing).
Within one chain the kept blocks are therefore always a prefix.

Pure module: no torch, no vllm; the clock is injected (tests use a fake).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SECONDS_PER_DAY = 86400.0
# The per-day window counts bytes in slots of this many seconds.
DAY_SLOT_S = 3600.0
DAY_SLOTS = int(SECONDS_PER_DAY // DAY_SLOT_S)

# store_skipped_blocks{tier="L3", reason=...}: which limit skipped a block.
REASON_BANDWIDTH = "write_budget"
REASON_DAY = "daily_budget"


def block_value(uses: int, depth: int) -> tuple[int, int]:
    """A stored block's worth to L3, larger is better: requests that used
    it, then how shallow it is (block ``depth`` of its chain)."""
    return (uses, -depth)


@dataclass(frozen=True)
class WriteBudgetConfig:
    """The limits, in bytes; 0 = that limit is off."""

    bytes_per_s: int = 0
    burst_bytes: int = 0          # 0 = one second of bytes_per_s
    bytes_per_day: int = 0

    @property
    def enabled(self) -> bool:
        return self.bytes_per_s > 0 or self.bytes_per_day > 0

    @property
    def bucket_bytes(self) -> int:
        return self.burst_bytes or self.bytes_per_s

    def check_block(self, block_bytes: int) -> None:
        """Refuse limits that could never admit one block of ``block_bytes``
        (every backup would be skipped: an L3 that is never written)."""
        if self.bytes_per_s and self.bucket_bytes < block_bytes:
            which = ("l3_write_burst_bytes" if self.burst_bytes
                     else "l3_write_budget_bytes_per_s (unset l3_write_burst_bytes is one "
                          "second of it)")
            raise ValueError(f"{which}={self.bucket_bytes} is below one block's L3 bytes "
                             f"({block_bytes}, all ranks' objects): no backup could ever be "
                             f"written; set l3_write_burst_bytes to at least {block_bytes}")
        if self.bytes_per_day and self.bytes_per_day < block_bytes:
            raise ValueError(f"l3_write_budget_bytes_per_day={self.bytes_per_day} is below one "
                             f"block's L3 bytes ({block_bytes}): no backup could ever be "
                             "written; raise it or remove it")


class WriteBudget:
    """The bucket and the day window (see module doc)."""

    def __init__(self, cfg: WriteBudgetConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self._tokens = float(cfg.bucket_bytes)
        self._filled_at = clock()
        # (slot number, bytes spent in it), oldest first, at most DAY_SLOTS.
        self._day: collections.deque[tuple[int, int]] = collections.deque()
        self.spent_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def _refill(self, now: float) -> None:
        if self.cfg.bytes_per_s:
            elapsed = max(0.0, now - self._filled_at)
            self._tokens = min(float(self.cfg.bucket_bytes),
                               self._tokens + elapsed * self.cfg.bytes_per_s)
        self._filled_at = now

    def _day_room(self, now: float) -> float:
        slot = int(now // DAY_SLOT_S)
        while self._day and self._day[0][0] <= slot - DAY_SLOTS:
            self._day.popleft()
        return self.cfg.bytes_per_day - sum(b for _, b in self._day)

    def room(self) -> tuple[float, str]:
        """Bytes that may be written now, and the limit that binds
        (``REASON_*``); infinite with both limits off."""
        now = self.clock()
        self._refill(now)
        room, reason = float("inf"), REASON_BANDWIDTH
        if self.cfg.bytes_per_s:
            room = self._tokens
        if self.cfg.bytes_per_day:
            day = self._day_room(now)
            if day < room:
                room, reason = day, REASON_DAY
        return max(0.0, room), reason

    def spend(self, num_bytes: int) -> None:
        """``num_bytes`` were planned for writing (within ``room``)."""
        if num_bytes <= 0:
            return
        now = self.clock()
        self._refill(now)
        self._tokens -= num_bytes
        self.spent_bytes += num_bytes
        if self.cfg.bytes_per_day:
            slot = int(now // DAY_SLOT_S)
            if self._day and self._day[-1][0] == slot:
                self._day[-1] = (slot, self._day[-1][1] + num_bytes)
            else:
                self._day.append((slot, num_bytes))


def pick_within(values: Sequence[tuple[int, int]], item_bytes: int,
                room_bytes: float) -> set[int]:
    """Indices of the most valuable items (``values``, larger is better;
    ties: earlier first) that fit in ``room_bytes`` at ``item_bytes`` each."""
    fits = len(values) if room_bytes == float("inf") else int(room_bytes // max(1, item_bytes))
    if fits >= len(values):
        return set(range(len(values)))
    order = sorted(range(len(values)), key=lambda i: (values[i], -i), reverse=True)
    return set(order[:max(0, fits)])
