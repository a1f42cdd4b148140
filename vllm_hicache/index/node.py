"""Nodes of the L2 index as a struct of arrays, lock handles, match results.

A node is an int id (a slot) into flat arrays owned by ``NodeStore``: no
Python object per node, so a million nodes cost neither a million objects'
headers nor a million objects for the garbage collector to scan. Slots are
reused after ``release``; ``serial`` (creation order, never reused) tells a
live node from a later one in the same slot.

A node holds a run of consecutive blocks. Its key is stored as the block
hash itself when the run has one block (the usual worst case: no list
object), or as a ``list`` of hashes when it has more. Its pages follow the
same split: ``page[n]`` is the page of a one-block node, ``PLACEHOLDER`` for
a placeholder (its blocks lie on the path to host-backed descendants but have
no L2 page) and ``IN_RUN`` for a host-backed run of several blocks, whose
pages are the ``array('q')`` in ``runs[n]``. A node is entirely host-backed or
entirely a placeholder. Children are a doubly linked sibling list (first
child, next and previous sibling); lookups by hash go through
``ChildIndex`` (child_index.py). Pure module.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable
from typing import NamedTuple

NO_NODE = -1
ROOT = 0
# ``page`` values that are not pages.
PLACEHOLDER = -1
IN_RUN = -2

Key = bytes | list[bytes]


def page_run(pages: Iterable[int]) -> array[int]:
    """Pages of one node, in block order."""
    return array("q", pages)


class NodeStore:
    """Every node's fields, indexed by node id. Mutated only by ``HiRadixTree``
    (``queued`` by ``EvictionQueue``). Slot 0 is the root: host-backed, no
    blocks, never released."""

    def __init__(self, now: float) -> None:
        self.parent = array("i")
        self.first_child = array("i")
        self.next_sibling = array("i")
        self.prev_sibling = array("i")
        self.lock_ref = array("i")
        self.hit_count = array("q")
        self.priority = array("q")
        self.last_access_time = array("d")
        self.creation_time = array("d")
        self.serial = array("q")
        self.page = array("q")
        # bytes (one block), list[bytes] (several) or None (a free slot).
        self.key: list[Key | None] = []
        self.runs: dict[int, array[int]] = {}
        # Cut off by ``invalidate`` while pinned: unreachable from the root,
        # its pages are freed when the last pin on it is released.
        self.orphaned = bytearray()
        # Host-backed non-root leaf known to the eviction queue.
        self.queued = bytearray()
        self._free_ids = array("i")
        self._next_serial = 0
        root = self.new(NO_NODE, [], page_run(()), now, 0)
        assert root == ROOT

    def __len__(self) -> int:
        """Slots, live or free."""
        return len(self.key)

    @property
    def num_live(self) -> int:
        """Live nodes, the root included."""
        return len(self.key) - len(self._free_ids)

    def is_live(self, node: int) -> bool:
        return 0 <= node < len(self.key) and self.key[node] is not None

    def new(self, parent: int, key: list[bytes], pages: array[int] | None, now: float,
            priority: int) -> int:
        """A node with no children and no links (``HiRadixTree`` links it)."""
        serial = self._next_serial
        self._next_serial += 1
        if self._free_ids:
            node = self._free_ids.pop()
            self.parent[node] = parent
            self.first_child[node] = self.next_sibling[node] = NO_NODE
            self.prev_sibling[node] = NO_NODE
            self.lock_ref[node] = self.hit_count[node] = 0
            self.priority[node] = priority
            self.last_access_time[node] = self.creation_time[node] = now
            self.serial[node] = serial
            self.orphaned[node] = self.queued[node] = 0
        else:
            node = len(self.key)
            self.parent.append(parent)
            self.first_child.append(NO_NODE)
            self.next_sibling.append(NO_NODE)
            self.prev_sibling.append(NO_NODE)
            self.lock_ref.append(0)
            self.hit_count.append(0)
            self.priority.append(priority)
            self.last_access_time.append(now)
            self.creation_time.append(now)
            self.serial.append(serial)
            self.page.append(PLACEHOLDER)
            self.key.append(None)
            self.orphaned.append(0)
            self.queued.append(0)
        self.set_run(node, key, pages)
        return node

    def release(self, node: int) -> None:
        """Free the slot of a node already unlinked from everything."""
        assert node != ROOT and self.key[node] is not None and not self.queued[node], node
        self.key[node] = None
        self.runs.pop(node, None)
        self.page[node] = PLACEHOLDER
        self.orphaned[node] = 0
        self._free_ids.append(node)

    # --- key and pages ----------------------------------------------------

    def set_run(self, node: int, key: list[bytes], pages: array[int] | None) -> None:
        """Store ``node``'s blocks and pages (None: placeholder) in the
        compact form for their length. ``key`` and ``pages`` are kept, not copied."""
        if len(key) == 1:
            self.key[node] = key[0]
            self.runs.pop(node, None)
            self.page[node] = PLACEHOLDER if pages is None else pages[0]
            return
        self.key[node] = key
        if pages is None:
            self.runs.pop(node, None)
            self.page[node] = PLACEHOLDER
        else:
            self.runs[node] = pages
            self.page[node] = IN_RUN

    def blocks(self, node: int) -> list[bytes]:
        """The node's block hashes (its own list for a run: do not mutate)."""
        key = self.key[node]
        if isinstance(key, list):
            return key
        if key is None:
            raise KeyError(f"node {node} is a free slot")
        return [key]

    def first_hash(self, node: int) -> bytes:
        key = self.key[node]
        if isinstance(key, list):
            return key[0]
        if key is None:
            raise KeyError(f"node {node} is a free slot")
        return key

    def num_blocks(self, node: int) -> int:
        key = self.key[node]
        return len(key) if isinstance(key, list) else 1

    def is_host(self, node: int) -> bool:
        return self.page[node] != PLACEHOLDER

    def pages(self, node: int) -> array[int] | None:
        """The node's pages (its own array for a run: do not mutate), or None."""
        page = self.page[node]
        if page == PLACEHOLDER:
            return None
        if page == IN_RUN:
            return self.runs[node]
        return page_run((page,))

    def num_pages(self, node: int) -> int:
        page = self.page[node]
        if page == PLACEHOLDER:
            return 0
        return len(self.runs[node]) if page == IN_RUN else 1

    # --- children ---------------------------------------------------------

    def children(self, node: int) -> list[int]:
        out = []
        child = self.first_child[node]
        while child != NO_NODE:
            out.append(child)
            child = self.next_sibling[child]
        return out

    def link(self, parent: int, child: int) -> None:
        """Add ``child`` (whose parent is already ``parent``) to its siblings."""
        head = self.first_child[parent]
        self.next_sibling[child] = head
        self.prev_sibling[child] = NO_NODE
        if head != NO_NODE:
            self.prev_sibling[head] = child
        self.first_child[parent] = child

    def unlink(self, child: int) -> None:
        """Take ``child`` out of its parent's children; its parent link stays."""
        prev, nxt = self.prev_sibling[child], self.next_sibling[child]
        if prev == NO_NODE:
            self.first_child[self.parent[child]] = nxt
        else:
            self.next_sibling[prev] = nxt
        if nxt != NO_NODE:
            self.prev_sibling[nxt] = prev
        self.next_sibling[child] = self.prev_sibling[child] = NO_NODE

    def subtree(self, top: int) -> list[int]:
        """``top`` and every node below it."""
        out, stack = [], [top]
        first_child, next_sibling = self.first_child, self.next_sibling
        while stack:
            node = stack.pop()
            out.append(node)
            child = first_child[node]
            while child != NO_NODE:
                stack.append(child)
                child = next_sibling[child]
        return out

    def describe(self, node: int) -> str:
        if not self.is_live(node):
            return f"node {node} (free slot)"
        pages = self.pages(node)
        kind = "placeholder" if pages is None else f"pages={pages.tolist()}"
        orphan = ", orphaned" if self.orphaned[node] else ""
        return (f"node {node} (serial {self.serial[node]}, blocks={self.num_blocks(node)}, "
                f"{kind}, lock_ref={self.lock_ref[node]}{orphan})")


class NodeRef(NamedTuple):
    """A node handed out by ``HiRadixTree.hot_nodes``: its slot and serial,
    so a slot reused by a later node is not mistaken for it."""

    node: int
    serial: int


class NodeView:
    """Read-only view of one node's fields (tests, debugging and policies'
    ``EvictableNode``); reads the store at each access."""

    __slots__ = ("_store", "id")

    def __init__(self, store: NodeStore, node: int) -> None:
        self._store = store
        self.id = node

    @property
    def parent(self) -> NodeView | None:
        parent = self._store.parent[self.id]
        return None if parent == NO_NODE else NodeView(self._store, parent)

    @property
    def children(self) -> dict[bytes, NodeView]:
        store = self._store
        return {store.first_hash(c): NodeView(store, c) for c in store.children(self.id)}

    @property
    def key(self) -> list[bytes]:
        return list(self._store.blocks(self.id))

    @property
    def pages(self) -> list[int] | None:
        pages = self._store.pages(self.id)
        return None if pages is None else pages.tolist()

    @property
    def lock_ref(self) -> int:
        return self._store.lock_ref[self.id]

    @property
    def hit_count(self) -> int:
        return self._store.hit_count[self.id]

    @property
    def priority(self) -> int:
        return self._store.priority[self.id]

    @property
    def last_access_time(self) -> float:
        return self._store.last_access_time[self.id]

    @property
    def creation_time(self) -> float:
        return self._store.creation_time[self.id]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, NodeView) and other._store is self._store
                and other.id == self.id)

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"NodeView({self._store.describe(self.id)})"


class LockHandle:
    """Proof of one ``HiRadixTree.lock``; give it to ``unlock`` exactly once."""

    __slots__ = ("_node", "_active", "num_blocks")

    def __init__(self, node: int, num_blocks: int) -> None:
        # Deepest pinned node; its ancestors (up to the root) are pinned too.
        # A pinned node is never released, so its slot stays this node's.
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
        run: list[int] = []
        for page in itertools.islice(self.pages, start_block, None):
            if page is None:
                break
            run.append(page)
        return run


class PinnedPages(NamedTuple):
    """Pages of pinned nodes (``HiRadixTree.pinned_pages``): those still
    matchable, and those in orphans (invalidated, waiting for their pins)."""

    indexed: frozenset[int]
    orphaned: frozenset[int]
