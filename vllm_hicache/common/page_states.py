"""Which L2 pages hold a usable recurrent state (models with a Mamba /
linear-attention group).

A page holds every group's data of one block position. Attention KV exists
at every position a request computed; a state group's block holds the state
of the prefix ending at the position's boundary only where vLLM kept it (a
forward ending on that boundary: the end of a prefill chunk, a decode step).
So a page's state part is valid at some positions and garbage at others.

Invariants, owned by the scheduler half:
- Every path that indexes a page sets its flag: the scheduler's stores (from
  ``GroupBlocks.holds_state`` once the step's forward has run) and L3
  prefetch commits (from what the objects say, on every rank). A freed
  page's flag is stale until the page is indexed again; nobody reads it
  meanwhile.
- A hit of N blocks loads the state of its page N-1 only (vLLM gives a
  state group one block, at the hit's last position), so a hit may end only
  at a page whose state is valid: ``usable`` cuts it there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PageStates:
    """One flag per L2 page."""

    def __init__(self, num_pages: int) -> None:
        self._valid = bytearray(num_pages)

    def mark(self, pages: Iterable[int], valid: Iterable[bool]) -> None:
        flags = self._valid
        for page, ok in zip(pages, valid):
            flags[page] = ok

    def valid(self, page: int) -> bool:
        return bool(self._valid[page])

    def usable(self, pages: Sequence[int]) -> int:
        """How many leading ``pages`` (a hit, block order) may be loaded:
        up to and including the last one whose state is valid."""
        flags = self._valid
        for n in range(len(pages), 0, -1):
            if flags[pages[n - 1]]:
                return n
        return 0
