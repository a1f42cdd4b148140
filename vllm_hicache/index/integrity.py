"""Full consistency check of the L2 index (tests and debugging; O(tree size)).

Pure module.
"""

from __future__ import annotations

from vllm_hicache.index.free_pages import FreePages
from vllm_hicache.index.node import RadixNode

# Enough problems to diagnose a failure without flooding the message.
_MAX_REPORTED = 8


def _check_node(node: RadixNode, leaves: set[RadixNode], problems: list[str]) -> None:
    """Local invariants of one non-root node and its child links."""
    if not node.key:
        problems.append(f"{node} has no blocks")
    if node.pages is not None and len(node.pages) != len(node.key):
        problems.append(f"{node} has {len(node.pages)} pages for {len(node.key)} blocks")
    if node.pages is None and not node.children and node.lock_ref == 0:
        problems.append(f"{node} is an unlocked placeholder without children")
    if node.lock_ref < 0:
        problems.append(f"{node} has lock_ref {node.lock_ref} < 0")
    parent = node.parent
    if parent is not None and parent.parent is not None and parent.lock_ref < node.lock_ref:
        problems.append(f"{node} locked more often than its parent {parent}")
    is_leaf = node.pages is not None and not node.children
    if is_leaf != (node in leaves):
        problems.append(f"{node} leaf={is_leaf} but in leaf set={node in leaves}")


def _walk(root: RadixNode, leaves: set[RadixNode], problems: list[str]) -> list[RadixNode]:
    """All non-root nodes, checking parent/child links on the way."""
    nodes: list[RadixNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        for first_hash, child in node.children.items():
            if child.parent is not node:
                problems.append(f"{child} parent link does not point to {node}")
            if not child.key or child.key[0] != first_hash:
                problems.append(f"{child} is filed under a hash that is not its first")
            _check_node(child, leaves, problems)
            nodes.append(child)
            stack.append(child)
    return nodes


def _check_pages(
    nodes: list[RadixNode], free: FreePages, num_pages: int, problems: list[str]
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
        for page in node.pages or ():
            place(page, f"in node {node.id}")
        cached += len(node.pages or ())
        locked += len(node.pages or ()) if node.lock_ref else 0
    return cached, locked


def _walk_orphans(
    orphans: set[RadixNode], leaves: set[RadixNode], problems: list[str]
) -> list[RadixNode]:
    """Nodes of the pinned subtrees cut off by ``invalidate``."""
    nodes: list[RadixNode] = []
    for top in orphans:
        if top.lock_ref <= 0:
            problems.append(f"orphan {top} is not pinned (its pages should be free)")
        parent = top.parent
        if parent is not None and parent.children.get(top.key[0]) is top:
            problems.append(f"orphan {top} is still linked under {parent}")
        stack = [top]
        while stack:
            node = stack.pop()
            if not node.orphaned:
                problems.append(f"{node} below orphan {top.id} is not marked orphaned")
            if node in leaves:
                problems.append(f"orphaned {node} is an eviction candidate")
            nodes.append(node)
            stack.extend(node.children.values())
    return nodes


def check_index(
    root: RadixNode,
    free: FreePages,
    leaves: set[RadixNode],
    orphans: set[RadixNode],
    *,
    num_pages: int,
    num_cached_pages: int,
    num_locked_pages: int,
) -> None:
    """Raise RuntimeError listing every broken invariant (see radix.py)."""
    problems: list[str] = []
    if root.key or len(root.pages) or root.parent is not None or root.lock_ref:
        problems.append(f"bad root {root}")
    nodes = _walk(root, leaves, problems)
    if len(leaves) > sum(1 for n in nodes if n in leaves):
        problems.append("leaf set holds nodes that are not in the tree")
    problems.extend(f"{n} is reachable but marked orphaned" for n in nodes if n.orphaned)
    nodes += _walk_orphans(orphans, leaves, problems)
    cached, locked = _check_pages(nodes, free, num_pages, problems)
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
