"""The L2 -> L3 boundary's admission rule (hicache_l3_admission), applied.

A block's uses at this boundary are counted once per request: the request
that computed it (its store to L2) and every request that hit it (or
declined an L2 hit on it), ``L3Backups.note_use``. The rule itself is
policy/admission.py's.

Inclusive mode asks when L2 stores a block (``filter``). A block the rule
declines then is remembered (bounded, least recently declined forgotten
first) with its chain; once later hits make the rule admit it, it is
backed up from L2 the next step if its page is still there
(``take_admitted``): under ``hits:2`` a prefix reaches L3 as it is hit the
second time. Exclusive mode asks when L2 is about to evict a block
(``select``, l3/victims.py). Pure module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence, Set

from vllm_hicache.common.page_ops import PinnedRange
from vllm_hicache.index import HiRadixTree
from vllm_hicache.policy.admission import Admission, AdmissionRule


class L3Admission:
    """Owned by L3Planner; single-threaded like it."""

    def __init__(self, rule: AdmissionRule, counter_capacity: int, block_size: int,
                 max_declined: int) -> None:
        assert max_declined > 0, max_declined
        self.rule = rule
        # Counted whatever the rule: value() ranks held and deferred blocks.
        self._admission = Admission(rule, counter_capacity, block_size, count_always=True)
        self._max_declined = max_declined
        # Declined block hash -> its chain (hashes of blocks 0 .. it).
        self._declined: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._admitted_later: list[tuple[bytes, ...]] = []
        # Counters (blocks): declined (inclusive: when stored; exclusive: when
        # L2 evicts them, ``select``), admitted by a later hit (inclusive).
        self.num_declined = 0
        self.num_admitted_later = 0

    @property
    def admits_all(self) -> bool:
        return self._admission.admits_all

    def record_use(self, hashes: Sequence[bytes]) -> None:
        """A request used blocks 0 .. len(hashes) - 1 of this chain (a hit):
        declined ones the rule now admits are backed up next step."""
        admission = self._admission
        admission.record_use(hashes)
        declined = self._declined
        if not declined:
            return
        in_chain = [i for i, h in enumerate(hashes) if h in declined]
        for i in admission.select(hashes, in_chain):
            self._admitted_later.append(declined.pop(hashes[i]))
            self.num_admitted_later += 1

    def select(self, chain: Sequence[bytes], blocks: list[int]) -> list[int]:
        """Of ``blocks`` (ascending) of ``chain``, those the rule admits now
        (exclusive mode's victims: the others are counted as declined)."""
        admitted = self._admission.select(chain, blocks)
        self.num_declined += len(blocks) - len(admitted)
        return admitted

    def hits(self, block_hash: bytes) -> int:
        """Requests that used this block, as far as the bounded count knows."""
        return self._admission.hits(block_hash)

    def value(self, chain: Sequence[bytes], block: int) -> int:
        """policy/admission.py's block_value of this block, from its counted uses."""
        return self._admission.value(chain, block)

    def count_stored(self, ranges: Iterable[PinnedRange],
                     counted: Set[bytes] = frozenset()) -> None:
        """The requests that computed these blocks used them once each.
        ``counted``: blocks a request of this step already counted as its hit
        (a prefix vLLM's own cache served, stored again because L2 had lost
        it): the same request, not a second use."""
        for rng in ranges:
            self._admission.record_use(h for h in (rng.chain[i] for i in rng.blocks)
                                       if h not in counted)

    def filter(self, ranges: list[PinnedRange]) -> list[PinnedRange]:
        """Of ranges just stored to L2 (their use already counted), the
        parts the rule admits now; the rest are remembered as declined."""
        if self._admission.admits_all:
            return ranges
        out = []
        for rng in ranges:
            keep = set(self._admission.select(rng.chain, rng.blocks))
            for b in rng.blocks:
                if b not in keep:
                    self._decline(rng.chain[: b + 1])
            if keep:
                picked = [(b, p) for b, p in zip(rng.blocks, rng.pages) if b in keep]
                last = picked[-1][0]
                out.append(PinnedRange(rng.chain[: last + 1], tuple(b for b, _ in picked),
                                       tuple(p for _, p in picked)))
        return out

    def _decline(self, chain: tuple[bytes, ...]) -> None:
        self.num_declined += 1
        declined = self._declined
        declined[chain[-1]] = chain
        declined.move_to_end(chain[-1])
        while len(declined) > self._max_declined:
            declined.popitem(last=False)

    def take_admitted(self, tree: HiRadixTree) -> list[PinnedRange]:
        """Declined blocks a later hit made admissible whose page L2 still has."""
        chains, self._admitted_later = self._admitted_later, []
        out = []
        for chain in chains:
            pages = tree.match(chain).pages
            page = pages[-1] if len(pages) == len(chain) else None
            if page is not None:
                out.append(PinnedRange(chain, (len(chain) - 1,), (page,)))
        return out

    def clear(self) -> None:
        """L2 was dropped: nothing declined is there to back up any more."""
        self._declined.clear()
        self._admitted_later.clear()
