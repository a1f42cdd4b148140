"""Radix-tree node, lock handle and match result of the L2 index.

A node holds a run of consecutive blocks. Its pages are an ``array('q')``
(``page_run``): 8 bytes a page, and nothing for the garbage collector to
scan, where a list would add an int object per page. ``pages is None`` marks a
placeholder: its blocks lie on the path to host-backed descendants but have
no L2 page (for example they are still only in vLLM's GPU cache). A node is
entirely host-backed or entirely a placeholder. Pure module.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import NamedTuple

# Creation order; breaks ties between equal policy keys deterministically.
_node_ids = itertools.count()
# The children of every leaf until it gets one: most nodes are leaves, and an
# empty dict each would cost 64 bytes and one more object for the collector.
# Read-only, so a write that bypasses ``adopt`` fails loudly.
NO_CHILDREN: Mapping[bytes, RadixNode] = MappingProxyType({})


def page_run(pages: Iterable[int]) -> array:
    """Pages of one node, in block order."""
    return array("q", pages)


class RadixNode:
    """One run of blocks. Mutated only by ``HiRadixTree``."""

    __slots__ = (
        "id", "parent", "children", "key", "pages", "lock_ref",
        "hit_count", "priority", "last_access_time", "creation_time", "orphaned",
    )

    def __init__(
        self,
        parent: RadixNode | None,
        key: list[bytes],
        pages: array | None,
        now: float,
        priority: int = 0,
    ) -> None:
        self.id = next(_node_ids)
        self.parent = parent
        # first block hash of the child's run -> child (add with ``adopt``)
        self.children: Mapping[bytes, RadixNode] = NO_CHILDREN
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.hit_count = 0
        self.priority = priority
        self.last_access_time = now
        self.creation_time = now
        # Cut off by ``invalidate`` while pinned: unreachable from the root,
        # its pages are freed when the last pin on it is released.
        self.orphaned = False

    def adopt(self, child: RadixNode) -> None:
        """Make ``child`` (whose parent is already ``self``) reachable."""
        if self.children is NO_CHILDREN:
            self.children = {}
        self.children[child.key[0]] = child  # type: ignore[index]

    def split(self, num_blocks: int) -> RadixNode:
        """Cut the first ``num_blocks`` blocks off into a new parent; return it.

        ``self`` keeps the tail, so a LockHandle pointing at ``self`` still
        reaches the new head when it walks up. The head copies every stat,
        lock_ref included: each lock through ``self`` also covered the head.
        """
        assert 0 < num_blocks < len(self.key), (num_blocks, len(self.key))
        parent = self.parent
        assert parent is not None
        head = RadixNode(parent, self.key[:num_blocks], None, self.creation_time)
        if self.pages is not None:
            head.pages = self.pages[:num_blocks]
            self.pages = self.pages[num_blocks:]
        head.lock_ref = self.lock_ref
        head.hit_count = self.hit_count
        head.priority = self.priority
        head.last_access_time = self.last_access_time
        self.key = self.key[num_blocks:]
        parent.adopt(head)
        head.adopt(self)
        self.parent = head
        return head

    def __repr__(self) -> str:
        kind = "placeholder" if self.pages is None else f"pages={self.pages.tolist()}"
        orphan = ", orphaned" if self.orphaned else ""
        return (f"RadixNode(id={self.id}, blocks={len(self.key)}, {kind}, "
                f"lock_ref={self.lock_ref}{orphan})")


class LockHandle:
    """Proof of one ``HiRadixTree.lock``; give it to ``unlock`` exactly once."""

    __slots__ = ("_node", "_active", "num_blocks")

    def __init__(self, node: RadixNode, num_blocks: int) -> None:
        # Deepest pinned node; its ancestors (up to the root) are pinned too.
        self._node = node
        self._active = True
        # Blocks the caller asked to pin (whole nodes may pin more).
        self.num_blocks = num_blocks


class MatchResult(NamedTuple):
    """What L2 holds of a request's chain, block 0 first.

    ``pages[i]`` is the host page of block i, or None where the path is a
    placeholder. It stops at the first block not in the tree. The pages are
    only safe to use while a lock covering them is held: ``alloc`` may evict.
    """

    pages: list[int | None]

    @property
    def num_blocks(self) -> int:
        return len(self.pages)

    def missing(self, lo: int, hi: int) -> list[int]:
        """Blocks in [lo, hi) without an L2 page: placeholders inside the
        match, then every block past it."""
        pages = self.pages
        absent = [i for i in range(lo, min(hi, len(pages))) if pages[i] is None]
        absent.extend(range(max(lo, len(pages)), hi))
        return absent

    def host_run(self, start_block: int) -> list[int]:
        """Consecutive host pages beginning at ``start_block`` (may be empty)."""
        pages = self.pages
        end = start_block
        while end < len(pages) and pages[end] is not None:
            end += 1
        return pages[start_block:end]  # type: ignore[return-value]


class PinnedPages(NamedTuple):
    """Pages of pinned nodes (``HiRadixTree.pinned_pages``): those still
    matchable, and those in orphans (invalidated, waiting for their pins)."""

    indexed: frozenset[int]
    orphaned: frozenset[int]
