"""Write policies: which computed blocks the scheduler half copies L1 -> L2.

- write_through: every computed full block the L1 -> L2 admission rule
  admits (policy/admission.py; by default ``always``), as soon as it is
  computed.
- write_through_selective: a block once it has been hit at least twice
  (computed once and reused once, counted per request that uses it): the
  admission rule ``hits:2`` under write-through, which it is mapped onto.
- write_back: nothing on compute; a block is copied only when vLLM is about
  to evict it from L1 (see scheduler/write_back.py); admits every block.

Hit counts for blocks not yet in L2 live in a bounded LRU table, so a long run
cannot grow it without limit. Pure module: no torch, no vllm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum

from vllm_hicache.policy.admission import (
    ALWAYS,
    Admission,
    AdmissionKind,
    AdmissionRule,
    HitCounter,
)

__all__ = ["HitCounter", "WritePolicy", "WritePolicyName", "hit_counter_slots",
           "l2_admission_rule"]


class WritePolicyName(StrEnum):
    """hicache_write_policy's values (a str: compares and prints as its name)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


WRITE_POLICIES = tuple(WritePolicyName)
# Uses a block needs under write_through_selective before it is stored.
SELECTIVE_WRITE_HITS = 2
SELECTIVE_RULE = AdmissionRule(AdmissionKind.HITS, min_hits=SELECTIVE_WRITE_HITS)
# Blocks the hit counter remembers, per L2 page (the engine and the
# capacity planner's replay size it alike).
HIT_COUNTER_SLOTS_PER_PAGE = 4


def hit_counter_slots(l2_pages: int) -> int:
    """The hit counter's capacity for an L2 of ``l2_pages`` pages."""
    return HIT_COUNTER_SLOTS_PER_PAGE * max(1, l2_pages)


def l2_admission_rule(policy: str, rule: AdmissionRule | None) -> AdmissionRule:
    """The L1 -> L2 rule in force under ``policy`` when the user asked for
    ``rule`` (None: nothing asked). write_through_selective is ``hits:2``
    and admits no other rule; write_back admits every block it copies."""
    if policy == WritePolicyName.WRITE_THROUGH_SELECTIVE:
        if rule is not None and rule != SELECTIVE_RULE:
            raise ValueError(
                f"hicache_write_policy=write_through_selective is the L1->L2 admission rule "
                f"{SELECTIVE_RULE}; it cannot be combined with hicache_l2_admission={rule} "
                f"(use hicache_write_policy=write_through with hicache_l2_admission={rule})")
        return SELECTIVE_RULE
    if policy == WritePolicyName.WRITE_BACK:
        if rule is not None and rule != ALWAYS:
            raise ValueError(
                f"hicache_write_policy=write_back copies every block vLLM evicts; it "
                f"takes no hicache_l2_admission rule (got {rule}): use write_through")
        return ALWAYS
    return rule if rule is not None else ALWAYS

class WritePolicy:
    """Decides, per computed block, whether to store it now.

    The scheduler half calls ``record_use`` once per request for the blocks it
    uses, and ``should_store`` (or ``select``) for newly computed full blocks.
    """

    def __init__(self, name: str, counter_capacity: int, rule: AdmissionRule | None = None,
                 block_size: int = 1) -> None:
        """``rule``: the L1 -> L2 admission rule asked for (None: the
        policy's own, ``l2_admission_rule``); ``block_size`` in tokens,
        for ``value:`` rules."""
        if name not in WRITE_POLICIES:
            raise ValueError(
                f"unknown hicache_write_policy {name!r}; accepted: {', '.join(WRITE_POLICIES)}"
            )
        self.name = name
        self.rule = l2_admission_rule(name, rule)
        self.threshold = self.rule.min_hits if self.rule.kind == AdmissionKind.HITS else 1
        admission = Admission(self.rule, counter_capacity, block_size)
        self._admission = None if admission.admits_all else admission

    @property
    def stores_on_compute(self) -> bool:
        return self.name != WritePolicyName.WRITE_BACK

    def record_use(self, hashes: Iterable[bytes]) -> None:
        if self._admission is not None:
            self._admission.record_use(hashes)

    def should_store(self, block_hash: bytes) -> bool:
        """Under a hits rule: has the block been used enough? (A value rule
        needs the block's position: ``select``.)"""
        if self._admission is None:
            return self.stores_on_compute
        return self._admission.hits(block_hash) >= self.threshold

    def select(self, hashes: Sequence[bytes], positions: list[int]) -> list[int]:
        """The ``positions`` (ascending indices into ``hashes``) to store
        now, as the admission rule says (write_through: no per-block call)."""
        if self._admission is None:
            return positions if self.stores_on_compute else []
        return self._admission.select(hashes, positions)

    def clear(self) -> None:
        if self._admission is not None:
            self._admission.clear()
