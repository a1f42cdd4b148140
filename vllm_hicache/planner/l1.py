"""vLLM's prefix cache (L1), simulated over an access log. Pure module.

L1 does not depend on L2 or L3 (a block loaded from L2 is cached in L1 like
one computed), so ``l1_pass`` runs once per log and hands the L2/L3 replay
(replay.py) one step per record: what L1 held when each request arrived,
its L1 hit when it was admitted, and what L1 evicted meanwhile.

A request holds its prompt's blocks from its admission; while it decodes
it gets one more block each time its tokens cross a block boundary, one
token a step (``_DecodeClock``), up to what it held when it finished.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import NamedTuple

from vllm_hicache.planner.log_format import Admit, Arrive, Finish, Record

Chain = tuple[bytes, ...]


def loadable_blocks(num_tokens: int, block_size: int) -> int:
    """Most blocks a hit may cover (keys.loadable_block_limit): one token is computed."""
    return max(0, (num_tokens - 1) // block_size)


class L1Cache:
    """vLLM's block pool with prefix caching, by block hash.

    ``_free`` is vLLM's free-block queue, oldest (next to be reused) first:
    a cached free block is keyed by its hash, an uncached one by an int. A
    hit takes cached blocks off the queue (``_refs`` counts their holders);
    an allocation pops blocks off its front, evicting their hashes; a
    request's cached blocks return to its tail last block first, so a prefix
    outlives its extensions, and its uncached ones to its front (vLLM 0.32's
    ``BlockPool.free_blocks``). Asking for more blocks than are free (vLLM
    would preempt) over-commits: the excess is dropped as blocks come back.

    With ``keep_evicted`` (write-back) it also keeps what WriteBackWatcher
    tracks (``_Tracked``); an evicted block is handed to the replay only if
    it is still tracked.
    """

    def __init__(self, num_blocks: int, keep_evicted: bool = False) -> None:
        self._free: OrderedDict[bytes | int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._fresh = itertools.count(num_blocks)
        # hash -> (chain, index): the chain that cached it (for write-back).
        self._cached: dict[bytes, tuple[Chain, int]] = {}
        self._refs: dict[bytes | int, int] = {}
        self._held: dict[int, list[bytes | int]] = {}
        self._excess = 0
        self._keep_evicted = keep_evicted
        # vLLM's num_gpu_blocks counts its null block.
        self._tracked = _Tracked(2 * (num_blocks + 1))
        # Chains of cached blocks evicted since the last ``take_evicted``.
        self._evicted: list[Chain] = []

    def mask(self, chain: Chain) -> bytes:
        """1 for each block of ``chain`` cached in L1, else 0."""
        cached = self._cached
        return bytes(h in cached for h in chain)

    def hit_blocks(self, chain: Chain, limit: int) -> int:
        n, cached = 0, self._cached
        while n < limit and chain[n] in cached:
            n += 1
        return n

    def admit(self, seq: int, chain: Chain, num_tokens: int, block_size: int) -> int:
        """Cache and hold the request's prompt; returns its hit in blocks."""
        again = seq in self._held
        if again:  # admitted again after a preemption: vLLM freed its
            self._cache(self._held[seq], chain, 0)  # blocks, the full ones cached
            self.release(seq)
        hit = self.hit_blocks(chain, loadable_blocks(num_tokens, block_size))
        self.observe(chain, hit if again else 0)
        keys: list[bytes | int] = []
        for h in chain[:hit]:
            self._hold(h)
            keys.append(h)
        self._allocate(keys, -(-num_tokens // block_size) - hit)
        self._cache(keys, chain, hit)
        self._held[seq] = keys
        return hit

    def grow(self, seq: int, num_blocks: int) -> None:
        """The request now holds ``num_blocks`` blocks (a decode step)."""
        keys = self._held.get(seq)
        if keys is not None and len(keys) < num_blocks:
            self._allocate(keys, num_blocks - len(keys))

    def finish(self, seq: int, num_blocks_held: int, full_chain: Chain) -> None:
        keys = self._held.get(seq)
        if keys is None:
            return
        self._allocate(keys, num_blocks_held - len(keys))
        self._cache(keys, full_chain, 0)
        self.release(seq)

    def release(self, seq: int) -> None:
        uncached = []
        for key in reversed(self._held.pop(seq)):
            refs = self._refs[key] - 1
            if refs:
                self._refs[key] = refs
                continue
            del self._refs[key]
            if self._excess:
                self._excess -= 1
                if not isinstance(key, int):
                    del self._cached[key]
            elif isinstance(key, int):
                uncached.append(key)
            else:
                self._free[key] = None
        for key in reversed(uncached):  # uncached blocks are reused first, in order
            self._free[key] = None
            self._free.move_to_end(key, last=False)

    def observe(self, chain: Chain, lo: int) -> None:
        """WriteBackWatcher.observe: blocks [lo, len(chain)) were computed."""
        if self._keep_evicted:
            self._tracked.observe(chain, lo)

    def take_evicted(self) -> list[Chain]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def _hold(self, key: bytes | int) -> None:
        refs = self._refs.get(key, 0)
        if refs == 0:
            self._free.pop(key, None)
        self._refs[key] = refs + 1

    def _allocate(self, keys: list[bytes | int], num_blocks: int) -> None:
        free = self._free
        for _ in range(max(0, num_blocks)):
            if free:
                old, _ = free.popitem(last=False)
                if not isinstance(old, int):
                    chain, i = self._cached.pop(old)
                    if self._keep_evicted and self._tracked.leave_l1(old):
                        self._evicted.append(chain[: i + 1])
            else:
                self._excess += 1
            key = next(self._fresh)
            self._refs[key] = 1
            keys.append(key)

    def _cache(self, keys: list[bytes | int], chain: Chain, start: int) -> None:
        """Give the request's uncached blocks [start, len(chain)) their hashes."""
        for i in range(start, min(len(chain), len(keys))):
            key, h = keys[i], chain[i]
            if isinstance(key, int) and h not in self._cached:
                self._cached[h] = (chain, i)
                del self._refs[key]
                self._refs[h] = self._refs.get(h, 0) + 1
                keys[i] = h


class _Tracked:
    """The blocks WriteBackWatcher can write back: observed computed, at
    most ``max_blocks`` of them. Beyond, the least recently observed one
    without a tracked child goes (a parent with tracked children is parked
    until its last child goes), so old chains shrink from their tails."""

    def __init__(self, max_blocks: int) -> None:
        self._max = max_blocks
        self._order: OrderedDict[bytes, None] = OrderedDict()
        self._parked: OrderedDict[bytes, None] = OrderedDict()
        self._parent: dict[bytes, bytes | None] = {}
        self._children: dict[bytes, int] = {}

    def observe(self, chain: Chain, lo: int) -> None:
        for i in range(lo, len(chain)):
            h = chain[i]
            if h in self._order:
                self._order.move_to_end(h)
            elif h in self._parked:
                del self._parked[h]
                self._order[h] = None
            else:
                self._order[h] = None
                parent = self._parent[h] = chain[i - 1] if i else None
                if parent is not None:
                    self._children[parent] = self._children.get(parent, 0) + 1
        while len(self._order) + len(self._parked) > self._max:
            if self._order:
                h = next(iter(self._order))
                if self._children.get(h):
                    del self._order[h]
                    self._parked[h] = None
                    continue
            else:
                h = next(iter(self._parked))
            self._untrack(h)

    def leave_l1(self, h: bytes) -> bool:
        """vLLM evicted ``h``: is it written back?"""
        if h not in self._order and h not in self._parked:
            return False
        if not self._children.get(h):  # else its children's chains still pass here
            self._untrack(h)
        return True

    def _untrack(self, h: bytes) -> None:
        if self._order.pop(h, 0) is not None:
            del self._parked[h]
        parent = self._parent.pop(h)
        if parent is None:
            return
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
            return
        del self._children[parent]
        if parent in self._parked:  # back to the front: everything else is newer
            del self._parked[parent]
            self._order[parent] = None
            self._order.move_to_end(parent, last=False)


class ArriveStep(NamedTuple):
    seq: int
    # The scheduler step it arrived before.
    step: int
    # The loadable blocks of its prompt, and which of them L1 held then.
    chain: Chain
    in_l1: bytes


class AdmitStep(NamedTuple):
    record: Admit
    # Its L1 hit, in blocks.
    l1_blocks: int
    # Chains of the cached blocks L1 evicted to make room (write-back stores them).
    evicted: list[Chain]
    # Its chain when it finished: the prompt's, then the blocks it decoded.
    final_chain: Chain


class FinishStep(NamedTuple):
    seq: int
    # It finished before this scheduler step.
    step: int
    # The whole chain (prompt, then the blocks completed while decoding).
    chain: Chain
    # Blocks [first_new, len(chain)) were computed while decoding.
    first_new: int
    evicted: list[Chain]


Step = ArriveStep | AdmitStep | FinishStep


class _DecodeClock:
    """When running requests get their decode blocks. Admitted at step a
    with P tokens, a request computes P + (s - a) tokens by step s (its
    prefill in one step, then a token a step), so it needs block b + 1 from
    step a + b * block_size - P + 1; never more than it held at FINISH.
    vLLM schedules running requests before waiting ones: the blocks due at a
    step are taken before that step's admissions."""

    def __init__(self, l1: L1Cache, block_size: int, final_blocks: dict[int, int]) -> None:
        self._l1 = l1
        self._block_size = block_size
        self._final = final_blocks
        self._running: dict[int, tuple[int, int, int]] = {}  # seq -> (step, tokens, gen)
        self._heap: list[tuple[int, int, int, int]] = []  # (due step, gen, seq, blocks)
        self._gens = itertools.count()

    def start(self, seq: int, step: int, num_tokens: int) -> None:
        gen = next(self._gens)
        self._running[seq] = (step, num_tokens, gen)
        self._schedule(seq, step, num_tokens, gen, -(-num_tokens // self._block_size))

    def stop(self, seq: int) -> None:
        self._running.pop(seq, None)

    def advance(self, step: int) -> None:
        """Give every running request the blocks it needs by ``step``."""
        heap = self._heap
        while heap and heap[0][0] <= step:
            _, gen, seq, num_blocks = heapq.heappop(heap)
            run = self._running.get(seq)
            if run is None or run[2] != gen:
                continue  # finished, or admitted again since
            self._l1.grow(seq, num_blocks)
            self._schedule(seq, run[0], run[1], gen, num_blocks)

    def _schedule(self, seq: int, step: int, num_tokens: int, gen: int, held: int) -> None:
        if held < self._final.get(seq, 0):
            due = step + held * self._block_size - num_tokens + 1
            heapq.heappush(self._heap, (due, gen, seq, held + 1))


def l1_pass(records: list[Record], l1_blocks: int, block_size: int,
            keep_evicted: bool = False) -> list[Step]:
    """Run vLLM's prefix cache over the log once."""
    l1 = L1Cache(l1_blocks, keep_evicted)
    first_admit: dict[int, Admit] = {}
    last_chain: dict[int, Chain] = {}
    final_blocks: dict[int, int] = {}
    final_chain: dict[int, Chain] = {}
    for rec in records:
        if isinstance(rec, Admit):
            first_admit.setdefault(rec.seq, rec)
            last_chain[rec.seq] = rec.chain
        elif isinstance(rec, Finish) and rec.seq in last_chain:
            final_blocks[rec.seq] = rec.num_blocks_held
            final_chain[rec.seq] = last_chain[rec.seq] + rec.chain_ext
    clock = _DecodeClock(l1, block_size, final_blocks)
    chains: dict[int, Chain] = {}
    steps: list[Step] = []
    for rec in records:
        if isinstance(rec, Arrive):
            admit = first_admit.get(rec.seq)
            if admit is not None:  # else never admitted (aborted while waiting)
                clock.advance(rec.step - 1)
                chain = admit.chain[: loadable_blocks(admit.prompt_tokens, block_size)]
                steps.append(ArriveStep(rec.seq, rec.step, chain, l1.mask(chain)))
        elif isinstance(rec, Admit):
            clock.advance(rec.step)
            hit = l1.admit(rec.seq, rec.chain, rec.prompt_tokens, block_size)
            clock.start(rec.seq, rec.step, rec.prompt_tokens)
            chains[rec.seq] = rec.chain
            steps.append(AdmitStep(rec, hit, l1.take_evicted(),
                                   final_chain.get(rec.seq, rec.chain)))
        elif isinstance(rec, Finish):
            prompt = chains.pop(rec.seq, None)
            if prompt is None:
                continue  # its ADMIT was dropped or sits in a file not given
            clock.advance(rec.step - 1)
            clock.stop(rec.seq)
            full = prompt + rec.chain_ext
            l1.observe(full, len(prompt))
            l1.finish(rec.seq, rec.num_blocks_held, full)
            steps.append(FinishStep(rec.seq, rec.step, full, len(prompt), l1.take_evicted()))
    return steps
