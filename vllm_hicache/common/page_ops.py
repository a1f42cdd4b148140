"""Live page operations of the scheduler half, and the pins they hold.

Invariant (docs/design.md, invariant 4): a page is pinned (its tree node
locked) from the moment the scheduler hands it to an operation until that
operation's terminal event, so eviction can never give it to another block
while a copy still reads or writes it. The terminal events:

| kind        | what it does to its pages      | terminal event                          |
| ----------- | ------------------------------ | --------------------------------------- |
| LOAD        | read: L2 -> L1 in step N       | step N acknowledged                     |
| ASYNC_LOAD  | read: L2 -> L1 between steps   | the request is reported finished_recving |
| STORE       | write: L1 -> L2 after step N's forward | step N acknowledged             |
| WRITE_BACK  | write: L1 -> L2 before step N's forward | step N acknowledged            |
| BACKUP      | read: L2 -> L3 after step N    | every rank acknowledged the backup      |
| VICTIM      | none: keeps an L2 page L3 lacks | its BACKUP op opened, or L3 declined it |

(VICTIM: exclusive L3, l3/victims.py.)

"Step N acknowledged" is the scheduler building step N+1: every rank runs a
step's copies in order (stores of N before anything of N+1, and L3 threads
wait on an event recorded after them), so any later use of a page released
then is ordered after its copy. L3 prefetches write pages that are not in
the tree yet (allocated, not inserted); ``L3Planner`` owns those.

Who writes a page excludes everyone else: a page in a live STORE is in no
other live operation, except a BACKUP of the same step (ordered after the
store) and loads of later steps (ordered after it); a WRITE_BACK copy runs
before its step's forward, so loads of its own step may read it too. ``check`` verifies this
and that every pinned page is pinned in the tree. Pure module.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import NamedTuple

from vllm_hicache.index import HiRadixTree, LockHandle


class OpKind(enum.Enum):
    LOAD = "load"
    ASYNC_LOAD = "async_load"
    STORE = "store"
    WRITE_BACK = "write_back"
    BACKUP = "backup"
    # Touches no bytes: keeps an L2 page that is not yet in L3 from being
    # evicted (exclusive L3) until its BACKUP op holds it.
    VICTIM = "victim"


# Kinds whose pages are released when the next step is built.
_STEP_SCOPED = (OpKind.LOAD, OpKind.STORE, OpKind.WRITE_BACK)
_WRITES = (OpKind.STORE, OpKind.WRITE_BACK)


class PinnedRange(NamedTuple):
    """Pages of one chain that an operation uses.

    ``chain`` holds the hashes of blocks 0 .. the last used block;
    ``pages[k]`` is the page of block ``blocks[k]`` of the chain.
    """

    chain: tuple[bytes, ...]
    blocks: tuple[int, ...]
    pages: tuple[int, ...]


@dataclass(slots=True)
class PageOp:
    op_id: int
    kind: OpKind
    step: int
    ranges: list[PinnedRange]
    locks: list[LockHandle]
    req_id: str | None = None
    # Loads: the vLLM blocks filled, aligned with ranges[0].pages.
    l1_blocks: tuple[int, ...] = ()
    closed: bool = False

    @property
    def pages(self) -> Iterator[int]:
        for r in self.ranges:
            yield from r.pages


class PageOps:
    """The ledger. Mutated only by the scheduler half (single-threaded)."""

    def __init__(self, tree: HiRadixTree) -> None:
        self._tree = tree
        self._ops: dict[int, PageOp] = {}
        self._ids = itertools.count()
        # Loads and stores of the last two steps, closed or not: a copy
        # failure can be reported after its step was acknowledged.
        self._recent: dict[int, list[PageOp]] = {}
        # Live ops per kind: has_pending_work asks on every engine loop.
        self._num_live: dict[OpKind, int] = dict.fromkeys(OpKind, 0)

    def open(self, kind: OpKind, step: int, ranges: Sequence[PinnedRange],
             req_id: str | None = None, l1_blocks: Sequence[int] = ()) -> PageOp:
        """Pin every range's chain up to its last used block; raises
        ValueError (pinning nothing) if the tree lost one of them."""
        locks: list[LockHandle] = []
        try:
            for r in ranges:
                locks.append(self._tree.lock(r.chain, len(r.chain)))
        except ValueError:
            for lock in locks:
                self._tree.unlock(lock)
            raise
        op = PageOp(next(self._ids), kind, step, list(ranges), locks, req_id, tuple(l1_blocks))
        self._ops[op.op_id] = op
        self._num_live[kind] += 1
        if kind not in (OpKind.BACKUP, OpKind.VICTIM):
            self._recent.setdefault(step, []).append(op)
        return op

    def close(self, op: PageOp) -> None:
        """The op reached its terminal event: release its pins."""
        if op.closed:
            return
        op.closed = True
        del self._ops[op.op_id]
        self._num_live[op.kind] -= 1
        for lock in op.locks:
            self._tree.unlock(lock)

    def close_step(self, step: int) -> None:
        """Step ``step`` is being built: every earlier step is acknowledged."""
        # Every step-scoped op is in _recent under its step (kept two steps,
        # and this runs every step): no scan of all live ops.
        for s in [s for s in self._recent if s < step]:
            for op in self._recent[s]:
                if op.kind in _STEP_SCOPED:
                    self.close(op)
        for old in [s for s in self._recent if s < step - 1]:
            del self._recent[old]

    def recent_uses(self, *, l1_blocks: AbstractSet[int] = frozenset(),
                    pages: AbstractSet[int] = frozenset()) -> Iterator[tuple[bytes, ...]]:
        """Chains (up to the block) of recent loads into ``l1_blocks`` and
        recent stores into ``pages``: what a copy failure report names."""
        for ops in self._recent.values():
            for op in ops:
                if op.kind in _WRITES:
                    for r in op.ranges:
                        for block, page in zip(r.blocks, r.pages):
                            if page in pages:
                                yield r.chain[: block + 1]
                elif l1_blocks:
                    r = op.ranges[0]
                    for block, block_id in zip(r.blocks, op.l1_blocks):
                        if block_id in l1_blocks:
                            yield r.chain[: block + 1]

    def num_live(self, kind: OpKind) -> int:
        return self._num_live[kind]

    def live(self, kind: OpKind | None = None) -> list[PageOp]:
        return [o for o in self._ops.values() if kind is None or o.kind == kind]

    def __len__(self) -> int:
        return len(self._ops)

    # --- checks ----------------------------------------------------------

    def check(self) -> list[str]:
        """Problems with the live operations (empty when all is well)."""
        problems: list[str] = []
        pinned = self._tree.pinned_pages()
        writer: dict[int, PageOp] = {}
        for op in self._ops.values():
            for r in op.ranges:
                indexed = self._tree.match(r.chain).pages
                for block, page in zip(r.blocks, r.pages):
                    if page in pinned.orphaned:
                        continue  # invalidated: freed once this op lets go
                    if page not in pinned.indexed:
                        problems.append(f"{op.kind.value} op {op.op_id} uses unpinned page {page}")
                    elif block >= len(indexed) or indexed[block] != page:
                        problems.append(f"{op.kind.value} op {op.op_id}: page {page} is not "
                                        f"the page of block {block} of its chain")
            if op.kind in _WRITES:
                for page in op.pages:
                    if page in writer:
                        problems.append(f"page {page} written by ops {writer[page].op_id} "
                                        f"and {op.op_id}")
                    writer[page] = op
        for op in self._ops.values():
            if op.kind in _WRITES or op.kind == OpKind.VICTIM:
                continue  # a VICTIM hold reads nothing
            for page in op.pages:
                w = writer.get(page)
                if w is None:
                    continue
                if op.kind == OpKind.BACKUP:
                    ordered = op.step == w.step
                elif w.kind == OpKind.WRITE_BACK:
                    ordered = op.step >= w.step
                else:
                    ordered = op.step > w.step
                if not ordered:
                    problems.append(f"page {page} of {op.kind.value} op {op.op_id} (step "
                                    f"{op.step}) is being written by store op {w.op_id} "
                                    f"(step {w.step})")
        return problems
