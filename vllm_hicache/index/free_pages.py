"""Free-page stack of the L2 pool, and the pages handed out but not inserted.

Every page 0..num_pages-1 is in exactly one place: this stack, the
``allocated`` set (taken by ``take``, not yet in the tree), or a tree node.
Pure module.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence


class FreePages:
    """O(1)-per-page allocator. Owned and mutated only by ``HiRadixTree``."""

    def __init__(self, num_pages: int) -> None:
        # A stack, reversed so that a fresh pool hands out 0, 1, 2, ...
        # (ascending runs make host copies more contiguous). An array: 8 bytes
        # a page, where a list of a million ints costs 40.
        self._stack = array("q", range(num_pages - 1, -1, -1))
        self.allocated: set[int] = set()

    def __len__(self) -> int:
        return len(self._stack)

    def take(self, num_pages: int) -> list[int]:
        """Move ``num_pages`` free pages to ``allocated``; caller checked len."""
        assert 0 <= num_pages <= len(self._stack), (num_pages, len(self._stack))
        if num_pages == 0:
            return []
        pages = self._stack[-num_pages:]
        del self._stack[-num_pages:]
        pages.reverse()
        self.allocated.update(pages)
        return pages.tolist()

    def give_back(self, pages: Sequence[int]) -> None:
        """Return allocated-but-not-inserted pages to the stack."""
        given = set(pages)
        if len(given) != len(pages) or not given <= self.allocated:
            bad = sorted(p for p in pages if p not in self.allocated)
            raise ValueError(
                f"free() of pages that are not allocated-and-uninserted {bad} "
                f"or listed twice (in {len(pages)} pages)"
            )
        self.allocated -= given
        self.push(pages)

    def claim(self, pages: Iterable[int]) -> None:
        """Pages leave ``allocated`` because the tree now holds them."""
        self.allocated.difference_update(pages)

    def push(self, pages: Sequence[int]) -> None:
        """Pages freed by the tree (eviction, clear) go back on the stack."""
        # Reversed so the next take() returns them in their original order.
        self._stack.extend(reversed(pages))

    def snapshot(self) -> list[int]:
        """Copy of the free stack, for integrity checks."""
        return list(self._stack)
