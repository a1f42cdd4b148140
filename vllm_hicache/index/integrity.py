"""Full consistency check of the L2 index (tests and debugging; O(tree size)).

Pure module.
"""

from __future__ import annotations

from vllm_hicache.index.child_index import ChildIndex
from vllm_hicache.index.eviction_queue import EvictionQueue
from vllm_hicache.index.free_pages import FreePages
from vllm_hicache.index.node import IN_RUN, NO_NODE, PLACEHOLDER, ROOT, NodeStore

# Enough problems to diagnose a failure without flooding the message.
_MAX_REPORTED = 8


def _check_form(store: NodeStore, node: int, problems: list[str]) -> None:
    """The compact form of a node's key and pages (node.py)."""
    key, page, name = store.key[node], store.page[node], store.describe(node)
    if type(key) is list:
        if len(key) < 2:
            problems.append(f"{name} keeps {len(key)} block(s) in a list")
        if page not in (PLACEHOLDER, IN_RUN):
            problems.append(f"{name} has several blocks but one page {page}")
    elif page == IN_RUN or page < PLACEHOLDER:
        problems.append(f"{name} has one block but page {page}")
    if (page == IN_RUN) != (node in store.runs):
        problems.append(f"{name} page {page} disagrees with its page run")
    pages = store.pages(node)
    if pages is not None and len(pages) != store.num_blocks(node):
        problems.append(f"{name} has {len(pages)} pages for {store.num_blocks(node)} blocks")


def _check_node(store: NodeStore, node: int, problems: list[str]) -> None:
    """Local invariants of one non-root node."""
    name = store.describe(node)
    _check_form(store, node, problems)
    leafless = store.first_child[node] == NO_NODE
    if not store.is_host(node) and leafless and store.lock_ref[node] == 0:
        problems.append(f"{name} is an unlocked placeholder without children")
    if store.lock_ref[node] < 0:
        problems.append(f"{name} has lock_ref {store.lock_ref[node]} < 0")
    parent = store.parent[node]
    if parent != ROOT and store.lock_ref[parent] < store.lock_ref[node]:
        problems.append(f"{name} locked more often than its parent {store.describe(parent)}")
    is_leaf = store.is_host(node) and leafless and not store.orphaned[node]
    if is_leaf != bool(store.queued[node]):
        problems.append(f"{name} leaf={is_leaf} but queued={bool(store.queued[node])}")


def _walk(store: NodeStore, index: ChildIndex, problems: list[str]) -> list[int]:
    """All reachable non-root nodes, checking child links on the way."""
    nodes: list[int] = []
    stack = [ROOT]
    while stack:
        node = stack.pop()
        prev = NO_NODE
        for child in store.children(node):
            name = store.describe(child)
            if not store.is_live(child):
                problems.append(f"{name} is linked under node {node}")
                continue
            if store.parent[child] != node or store.prev_sibling[child] != prev:
                problems.append(f"{name} parent or sibling links do not lead to node {node}")
            if index.find(node, store.first_hash(child)) != child:
                problems.append(f"{name} is not found under its first hash")
            if store.orphaned[child]:
                problems.append(f"{name} is reachable but marked orphaned")
            _check_node(store, child, problems)
            nodes.append(child)
            stack.append(child)
            prev = child
    if len(index) != len(nodes):
        problems.append(f"child index holds {len(index)} nodes, {len(nodes)} are reachable")
    return nodes


def _walk_orphans(
    store: NodeStore, index: ChildIndex, orphans: set[int], problems: list[str]
) -> list[int]:
    """Nodes of the pinned subtrees cut off by ``invalidate``."""
    nodes: list[int] = []
    for top in orphans:
        name = store.describe(top)
        if not store.is_live(top) or store.lock_ref[top] <= 0:
            problems.append(f"orphan {name} is not pinned (its pages should be free)")
            continue
        if index.find(store.parent[top], store.first_hash(top)) == top or top in \
                store.children(store.parent[top]):
            problems.append(f"orphan {name} is still linked under its parent")
        for node in store.subtree(top):
            if not store.orphaned[node]:
                problems.append(f"{store.describe(node)} below orphan {top} is not marked orphaned")
            if store.queued[node]:
                problems.append(f"orphaned {store.describe(node)} is an eviction candidate")
            _check_form(store, node, problems)
            nodes.append(node)
    return nodes


def _check_queue(store: NodeStore, queue: EvictionQueue, reachable: list[int],
                 problems: list[str]) -> None:
    """Every eligible leaf has an entry with its current key (so ``pop``
    agrees with sorting the leaves), and the candidate count is right."""
    queued = [node for node in reachable if store.queued[node]]
    if len(queued) != len(queue) or len(list(queue)) != len(queue):
        problems.append(f"queue counts {len(queue)} leaves, {len(queued)} reachable are queued")
    current = {(*entry[:3],) for entry in queue.entries()
               if store.is_live(entry[3]) and store.serial[entry[3]] == entry[2]}
    for node in queued:
        if store.lock_ref[node] == 0 and (*queue.key(node), store.serial[node]) not in current:
            problems.append(f"eligible leaf {store.describe(node)} has no current queue entry")


def _check_pages(
    store: NodeStore, nodes: list[int], free: FreePages, num_pages: int, problems: list[str]
) -> tuple[int, int]:
    """Each page in one place only; returns (cached, locked) page counts."""
    owner: dict[int, str] = {}

    def place(page: int, where: str) -> None:
        if not 0 <= page < num_pages:
            problems.append(f"page {page} ({where}) outside [0, {num_pages})")
        elif page in owner:
            problems.append(f"page {page} is both {owner[page]} and {where}")
        else:
            owner[page] = where

    for page in free.snapshot():
        place(page, "free")
    for page in free.allocated:
        place(page, "allocated")
    cached = locked = 0
    for node in nodes:
        pages = store.pages(node) or ()
        for page in pages:
            place(page, f"in node {node}")
        cached += len(pages)
        locked += len(pages) if store.lock_ref[node] else 0
    return cached, locked


def check_index(
    store: NodeStore,
    index: ChildIndex,
    queue: EvictionQueue,
    free: FreePages,
    orphans: set[int],
    *,
    num_pages: int,
    num_cached_pages: int,
    num_locked_pages: int,
) -> None:
    """Raise RuntimeError listing every broken invariant (see radix.py)."""
    problems: list[str] = []
    if (store.key[ROOT] != [] or store.num_pages(ROOT) or store.parent[ROOT] != NO_NODE
            or store.lock_ref[ROOT] or store.queued[ROOT]):
        problems.append(f"bad root {store.describe(ROOT)}")
    nodes = _walk(store, index, problems)
    _check_queue(store, queue, nodes, problems)
    nodes += _walk_orphans(store, index, orphans, problems)
    if store.num_live != 1 + len(nodes):
        problems.append(f"{store.num_live - 1} live nodes, {len(nodes)} reachable or orphaned")
    cached, locked = _check_pages(store, nodes, free, num_pages, problems)
    num_free, num_allocated = len(free), len(free.allocated)
    if num_free + cached + num_allocated != num_pages:
        problems.append(
            f"free({num_free}) + cached({cached}) + allocated({num_allocated}) "
            f"!= num_pages({num_pages})"
        )
    if cached != num_cached_pages:
        problems.append(f"cached pages counted {num_cached_pages}, actual {cached}")
    if locked != num_locked_pages:
        problems.append(f"locked pages counted {num_locked_pages}, actual {locked}")
    if problems:
        more = len(problems) - _MAX_REPORTED
        tail = [f"... and {more} more"] if more > 0 else []
        raise RuntimeError("HiRadixTree integrity: " + "; ".join(problems[:_MAX_REPORTED] + tail))
