"""Exclusive (victim) L3: a block goes to L3 when L2 evicts it, not when L2
stores it, so L2 and L3 together hold more distinct blocks.

Every page L2 stores (L1 -> L2, write-through or write-back) is *held*: a
VICTIM page op (common/page_ops.py) pins it, so the tree can evict it only
once it is *clean* (in L3, or declined by L3's admission rule). Each step,
while fewer than ``reserve_pages`` pages are free or evictable, the oldest
held pages (least recently used first) are released: those
hicache_l3_admission admits are handed to a BACKUP op first, which takes
over the pin until every rank acknowledged the write (the very mechanism an
inclusive backup and write-back's "copy before the block is reused" use: a
page op's pin, released at its terminal event), the others are unpinned at
once. So no admitted page is freed before every rank has written it, and L2
eviction, when every page is held, waits for backups: stores are skipped
meanwhile (counted, as when pages are pinned for any other reason).

An L3 hit promoted into L2 (a prefetch) *stays* in L3: another instance
sharing the store may still need the object, and deleting from a shared
store races with its readers. L2 and L3 therefore overlap by the blocks
promoted since (and by blocks another instance wrote): exclusive means "L2
never writes what it stores", not "no block is in both".

Invariant (``check``): every held page is the page of its block in the
tree (pinned by its op); a block is held by at most one op. Pure module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from vllm_hicache.common.page_ops import OpKind, PageOp, PageOps, PinnedRange
from vllm_hicache.index import HiRadixTree

# Pages kept free or evictable, as a fraction of L2 (at least one step's
# worth of stores, most steps): the headroom stores and prefetches allocate
# from without waiting for a backup.
RESERVE_FRACTION = 1 / 8
MIN_RESERVE_PAGES = 4


def reserve_pages(num_pages: int) -> int:
    """Pages exclusive mode keeps free or evictable in an L2 of ``num_pages``."""
    return min(num_pages, max(MIN_RESERVE_PAGES, int(num_pages * RESERVE_FRACTION)))


# value(chain, block) -> the block's value (policy/admission.py's block_value).
Value = Callable[[Sequence[bytes], int], int]
# select(chain, blocks) -> the blocks (ascending) L3's admission rule admits.
Select = Callable[[Sequence[bytes], list[int]], list[int]]


class VictimHolds:
    """The VICTIM ops of one L3 planner, least recently used first."""

    def __init__(self, ops: PageOps, reserve: int) -> None:
        self._ops = ops
        self.reserve = reserve
        self._held: OrderedDict[int, PageOp] = OrderedDict()
        self._op_of: dict[bytes, int] = {}   # held block hash -> its op id
        self.num_backed_up = 0               # blocks handed to a backup
        self.num_declined = 0                # blocks released unwritten

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._op_of)

    def hold(self, ranges: Sequence[PinnedRange], step: int) -> None:
        """Pages just stored to L2 (their STORE or WRITE_BACK op pins them
        now): hold them until they are backed up or declined."""
        for rng in ranges:
            fresh = [(b, p) for b, p in zip(rng.blocks, rng.pages)
                     if rng.chain[b] not in self._op_of]
            if not fresh:
                continue
            last = fresh[-1][0]
            held = PinnedRange(rng.chain[: last + 1], tuple(b for b, _ in fresh),
                               tuple(p for _, p in fresh))
            op = self._ops.open(OpKind.VICTIM, step, [held])
            self._held[op.op_id] = op
            for b in held.blocks:
                self._op_of[held.chain[b]] = op.op_id

    def note_use(self, hashes: Sequence[bytes]) -> None:
        """A request used these blocks: their holds become the most recent."""
        if not self._op_of:
            return
        for h in hashes:
            op_id = self._op_of.get(h)
            if op_id is not None:
                self._held.move_to_end(op_id)

    def deficit(self, tree: HiRadixTree) -> int:
        """Pages to release so that ``reserve`` are free or evictable."""
        evictable = tree.num_free_pages + tree.num_cached_pages - tree.num_locked_pages
        return self.reserve - evictable

    def release(self, num_pages: int, tree: HiRadixTree, select: Select,
                backup: Callable[[list[PinnedRange]], None], max_backup: int) -> None:
        """Release the oldest holds until ``num_pages`` pages are released
        or ``max_backup`` pages went to ``backup`` (which must open the
        BACKUP op, pinning them, before this drops their hold). ``select``:
        of a held run's blocks still in L2, those L3 admits."""
        released = backed = 0
        while self._held and released < num_pages and backed < max_backup:
            op_id, op = self._held.popitem(last=False)
            to_back: list[PinnedRange] = []
            for rng in op.ranges:
                live = tree.match(rng.chain).pages
                there = [(b, p) for b, p in zip(rng.blocks, rng.pages)
                         if b < len(live) and live[b] == p]
                keep = set(select(rng.chain, [b for b, _ in there]))
                picked = [(b, p) for b, p in there if b in keep]
                released += len(rng.blocks)
                self.num_declined += len(rng.blocks) - len(picked)
                if picked:
                    last = picked[-1][0]
                    to_back.append(PinnedRange(rng.chain[: last + 1],
                                               tuple(b for b, _ in picked),
                                               tuple(p for _, p in picked)))
                    backed += len(picked)
                    self.num_backed_up += len(picked)
                for b in rng.blocks:
                    self._op_of.pop(rng.chain[b], None)
            if to_back:
                backup(to_back)
            self._ops.close(op)

    def l2_only_by_value(self, value: Value) -> list[tuple[tuple[bytes, ...], int, int]]:
        """Held blocks (in L2, not in L3) as (chain through the block, page,
        value), most valuable first: what to write out at a graceful stop."""
        out = [(rng.chain[: b + 1], p, value(rng.chain, b))
               for op in self._held.values() for rng in op.ranges
               for b, p in zip(rng.blocks, rng.pages)]
        out.sort(key=lambda item: -item[2])
        return out

    def release_all(self) -> int:
        """Drop every hold (L2 cleared, or L3 detached); blocks released."""
        n = len(self._op_of)
        for op in self._held.values():
            self._ops.close(op)
        self._held.clear()
        self._op_of.clear()
        return n

    def check(self) -> list[str]:
        """Problems with the holds (empty when all is well)."""
        problems = []
        counted = 0
        for op_id, op in self._held.items():
            if op.closed:
                problems.append(f"victim hold {op_id} is closed but still listed")
            for rng in op.ranges:
                for b in rng.blocks:
                    counted += 1
                    if self._op_of.get(rng.chain[b]) != op_id:
                        problems.append(f"victim hold {op_id}: block {b} not indexed to it")
        if counted != len(self._op_of):
            problems.append(f"{len(self._op_of)} blocks indexed, {counted} held")
        return problems
