"""Admission rules: which blocks cross a tier boundary (L1 -> L2, L2 -> L3).

Each boundary has its own rule, written as a short string and parsed once
(``parse_admission``) into a frozen ``AdmissionRule``:

- ``always``: every block that reaches the boundary crosses it;
- ``hits:N`` (N >= 1): a block crosses once N requests have used it
  (computed it or hit it) — SGLang's selective write threshold, per boundary;
  ``hits:1`` is ``always``;
- ``value:V`` (V > 0): a block crosses once its value, ``block_value``, is at
  least V token-uses.

The value of a block is ``hits x prefix_tokens``: the requests that used it
times the tokens of the prefix it ends, i.e. the prefill a hit on it saves
(a deep block saves its whole prefix, and attention makes deep tokens the
dearest). Every consumer that ranks blocks (admission, a write budget that
skips the lowest first) uses this one function.

Prefix closure under ``value:V``: L3 and L2 lookups go by prefix, so a
block stored without the blocks before it is never found, yet a shallow
block can be worth less than the deeper one it leads to. So ``value:V``
admits, of the candidate blocks of one chain, every candidate up to the
deepest one it admits (``Admission.select``). ``hits:N`` needs no closure
(a request that uses a block uses its prefix too, so hits never grow along a
chain) and filters block by block, exactly as write_through_selective does.

Hit counts live in a bounded LRU table (``HitCounter``), so a long run
cannot grow it without limit: a block forgotten by it starts from zero.

``L3Mode`` says when a block reaches the L2 -> L3 boundary: ``inclusive``
when L2 stores it (L3 holds a copy of L2), ``exclusive`` when L2 is about to
evict it (l3/victims.py). Pure module: no torch, no vllm.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class AdmissionKind(StrEnum):
    ALWAYS = "always"
    HITS = "hits"
    VALUE = "value"


class L3Mode(StrEnum):
    """hicache_l3_mode's values."""

    INCLUSIVE = "inclusive"
    EXCLUSIVE = "exclusive"


ADMISSION_GRAMMAR = "'always', 'hits:N' (N >= 1) or 'value:V' (V > 0, token-uses)"


@dataclass(frozen=True)
class AdmissionRule:
    kind: AdmissionKind = AdmissionKind.ALWAYS
    # HITS: requests that must have used a block.
    min_hits: int = 1
    # VALUE: the least block_value admitted.
    min_value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind == AdmissionKind.HITS and self.min_hits < 1:
            raise ValueError(f"hits:N needs N >= 1, got {self.min_hits}")
        if self.kind == AdmissionKind.VALUE and not (
                math.isfinite(self.min_value) and self.min_value > 0):
            raise ValueError(f"value:V needs a finite V > 0, got {self.min_value}")

    def __str__(self) -> str:
        if self.kind == AdmissionKind.HITS:
            return f"hits:{self.min_hits}"
        if self.kind == AdmissionKind.VALUE:
            return f"value:{self.min_value:g}"
        return "always"

    @property
    def counts_hits(self) -> bool:
        """Does the rule need per-block hit counts (anything but always)?"""
        return not (self.kind == AdmissionKind.ALWAYS
                    or (self.kind == AdmissionKind.HITS and self.min_hits == 1))

    def admits(self, hits: int, prefix_tokens: int) -> bool:
        """Does a block used by ``hits`` requests, ending a prefix of
        ``prefix_tokens`` tokens, cross the boundary?"""
        if self.kind == AdmissionKind.HITS:
            return hits >= self.min_hits
        if self.kind == AdmissionKind.VALUE:
            return block_value(hits, prefix_tokens) >= self.min_value
        return True


ALWAYS = AdmissionRule()


def parse_admission(value: object) -> AdmissionRule:
    """A rule from its string (or an AdmissionRule, returned as is)."""
    if isinstance(value, AdmissionRule):
        return value
    if not isinstance(value, str):
        raise ValueError(f"an admission rule is a string, {ADMISSION_GRAMMAR}; "
                         f"got {type(value).__name__} {value!r}")
    text = value.strip().lower()
    if text == AdmissionKind.ALWAYS:
        return ALWAYS
    kind, sep, arg = text.partition(":")
    try:
        if sep and kind == AdmissionKind.HITS:
            return AdmissionRule(AdmissionKind.HITS, min_hits=int(arg))
        if sep and kind == AdmissionKind.VALUE:
            return AdmissionRule(AdmissionKind.VALUE, min_value=float(arg))
    except ValueError as exc:
        raise ValueError(f"bad admission rule {value!r} ({exc}); accepted: "
                         f"{ADMISSION_GRAMMAR}") from None
    raise ValueError(f"unknown admission rule {value!r}; accepted: {ADMISSION_GRAMMAR}")


def block_value(hits: int, prefix_tokens: int) -> int:
    """A block's value in token-uses: the prefill its hits save (module doc)."""
    return hits * prefix_tokens


class HitCounter:
    """Bounded LRU map block hash -> number of requests that used the block."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0, capacity
        self.capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def record(self, hashes: Iterable[bytes]) -> None:
        counts = self._counts
        for h in hashes:
            counts[h] = counts.pop(h, 0) + 1
        while len(counts) > self.capacity:
            counts.popitem(last=False)

    def count(self, block_hash: bytes) -> int:
        return self._counts.get(block_hash, 0)

    def clear(self) -> None:
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)


class Admission:
    """One boundary's rule and the hit counts it needs.

    The owner calls ``record_use`` once per request for the blocks that
    request used at this boundary, then ``select`` for candidate blocks.
    """

    def __init__(self, rule: AdmissionRule, counter_capacity: int, block_size: int,
                 count_always: bool = False) -> None:
        """``count_always``: count hits even under a rule that needs none
        (for ``value``, which ranks blocks whatever the rule)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.rule = rule
        self.block_size = block_size
        self.admits_all = not rule.counts_hits
        self._counter = (HitCounter(counter_capacity) if rule.counts_hits or count_always
                         else None)

    def record_use(self, hashes: Iterable[bytes]) -> None:
        if self._counter is not None:
            self._counter.record(hashes)

    def hits(self, block_hash: bytes) -> int:
        return self._counter.count(block_hash) if self._counter is not None else 0

    def value(self, chain: Sequence[bytes], block: int) -> int:
        """block_value of block ``block`` of ``chain`` (hashes of blocks 0 ..)."""
        return block_value(self.hits(chain[block]), (block + 1) * self.block_size)

    def admits(self, chain: Sequence[bytes], block: int) -> bool:
        if self.admits_all:
            return True
        return self.rule.admits(self.hits(chain[block]), (block + 1) * self.block_size)

    def select(self, chain: Sequence[bytes], positions: Sequence[int]) -> list[int]:
        """The ``positions`` (ascending indices into ``chain``) that cross;
        under ``value:V`` every one up to the deepest it admits (module doc)."""
        if self.admits_all:
            return list(positions)
        if self.rule.kind != AdmissionKind.VALUE:
            return [i for i in positions if self.admits(chain, i)]
        for k in range(len(positions) - 1, -1, -1):
            if self.admits(chain, positions[k]):
                return list(positions[: k + 1])
        return []

    def clear(self) -> None:
        if self._counter is not None:
            self._counter.clear()
