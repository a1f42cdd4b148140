"""Reuse distances of prefixes, their CDF, and the knee of the hit-rate curve.

The reuse distance of a block access is the number of distinct blocks used
since the previous access of that block (Mattson's stack distance). An LRU
cache of C blocks hits exactly the accesses with distance < C, so the CDF of
distances, weighted by tokens, is the hit rate of an ideal single LRU cache
against its size, for every size at once: the upper envelope of what L1 + L2
+ L3 can do together (the real tiers add per-tier policies, the loadable
limit, and prefetch thresholds).

Every block of every ADMIT (its prompt's chain) and FINISH (blocks computed
while decoding) is an access; only the loadable blocks of an ADMIT count
towards the CDF (a hit there saves prefill). Distances are counted with a
Fenwick tree over access times: O(log n) per access, about 10 us in
CPython; sample big logs (``hicache_access_log_sample``). Pure module.
"""

from __future__ import annotations

import bisect
import itertools
import math
from array import array
from dataclasses import dataclass

from vllm_hicache.planner.l1 import loadable_blocks
from vllm_hicache.planner.log_format import Admit, Finish, Record


class _Fenwick:
    def __init__(self, size: int) -> None:
        self._tree = array("l", bytes(8 * (size + 1)))
        self._size = size

    def add(self, i: int, delta: int) -> None:
        i += 1
        tree, size = self._tree, self._size
        while i <= size:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of positions [0, i)."""
        total, tree = 0, self._tree
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


@dataclass
class ReuseProfile:
    # (distance in blocks, tokens), ascending by distance.
    histogram: list[tuple[int, int]]
    # Prompt tokens, all of them (the CDF's denominator).
    prompt_tokens: int
    # Tokens of loadable blocks seen for the first time.
    cold_tokens: int
    # Distinct blocks in the log (its footprint).
    distinct_blocks: int

    def __post_init__(self) -> None:
        self._distances = [d for d, _ in self.histogram]
        self._cumulative = list(itertools.accumulate(w for _, w in self.histogram))

    def hit_rate(self, capacity_blocks: float) -> float:
        """Hit rate of an ideal LRU cache of this many blocks."""
        k = bisect.bisect_left(self._distances, capacity_blocks)
        if not self.prompt_tokens or k == 0:
            return 0.0
        return self._cumulative[k - 1] / self.prompt_tokens

    @property
    def max_hit_rate(self) -> float:
        """The hit rate of an unbounded cache: every reuse hits."""
        return self.hit_rate(math.inf)

    def cdf(self) -> list[tuple[int, float]]:
        """(capacity in blocks, hit rate) at each distinct distance + 1."""
        return [(d + 1, c / self.prompt_tokens)
                for d, c in zip(self._distances, self._cumulative)]


def reuse_profile(records: list[Record], block_size: int) -> ReuseProfile:
    chains: dict[int, tuple[bytes, ...]] = {}
    # (chain, how many of its leading blocks count towards the CDF)
    accesses: list[tuple[tuple[bytes, ...], int]] = []
    prompt_tokens = 0
    for rec in records:
        if isinstance(rec, Admit):
            chains[rec.seq] = rec.chain
            prompt_tokens += rec.prompt_tokens
            accesses.append((rec.chain, loadable_blocks(rec.prompt_tokens, block_size)))
        elif isinstance(rec, Finish) and chains.pop(rec.seq, None) is not None:
            accesses.append((rec.chain_ext, 0))
    total = sum(len(chain) for chain, _ in accesses)
    fenwick = _Fenwick(total)
    last: dict[bytes, int] = {}
    weights: dict[int, int] = {}
    cold = 0
    now = 0
    for chain, counted in accesses:
        for i, h in enumerate(chain):
            prev = last.get(h)
            if prev is not None:
                distance = fenwick.prefix(now) - fenwick.prefix(prev + 1)
                fenwick.add(prev, -1)
                if i < counted:
                    weights[distance] = weights.get(distance, 0) + block_size
            elif i < counted:
                cold += block_size
            fenwick.add(now, 1)
            last[h] = now
            now += 1
    return ReuseProfile(sorted(weights.items()), prompt_tokens, cold, len(last))


def knee(profile: ReuseProfile, step: float = 0.10, gain: float = 0.01) -> int | None:
    """Smallest capacity (blocks) beyond which ``step`` more capacity never
    buys ``gain`` more hit rate; None when nothing is ever reused."""
    if not profile.histogram:
        return None
    top = profile.histogram[-1][0] + 1
    grid = [1.0]
    while grid[-1] < top:
        grid.append(grid[-1] * (1 + step))
    rates = [profile.hit_rate(c) for c in grid] + [profile.max_hit_rate]
    knee_at = 0
    for k in range(len(grid)):
        if rates[k + 1] - rates[k] >= gain:
            knee_at = k + 1
    return math.ceil(grid[min(knee_at, len(grid) - 1)])
