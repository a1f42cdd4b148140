"""What a replay is run with and what it finds (ReplayConfig, ReplayResult),
and the L3 it simulates (L3Store). Pure module."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm_hicache.planner.l1 import Chain
from vllm_hicache.policy.admission import ALWAYS, AdmissionRule, L3Mode


class L3Store:
    """Objects by block hash, least recently used evicted first. A write of
    an object it has is skipped (no touch), a read (prefetch) touches."""

    def __init__(self, num_objects: int | None) -> None:
        self.num_objects = num_objects  # None: unlimited
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def prefix_len(self, hashes: Chain) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self._lru:
            n += 1
        return n

    def read(self, hashes: Chain) -> None:
        for h in hashes:
            if h in self._lru:
                self._lru.move_to_end(h)

    def write(self, hashes: Iterable[bytes]) -> int:
        """Objects actually written (those it lacked)."""
        lru = self._lru
        written = 0
        for h in hashes:
            if h not in lru:
                lru[h] = None
                written += 1
        if self.num_objects is not None:
            while len(lru) > self.num_objects:
                lru.popitem(last=False)
        return written


@dataclass(frozen=True)
class ReplayConfig:
    block_size: int
    l1_blocks: int
    l2_pages: int
    # L3 capacity in objects (one per block, all ranks together); None =
    # unlimited, 0 = no L3.
    l3_objects: int | None = 0
    eviction_policy: str = "lru"
    write_policy: str = "write_through"
    l3_threshold_blocks: int = 1
    # Does a request wait for its own prefetch (wait_complete, timeout) or
    # not (best_effort: it gets what landed before it was admitted)?
    prefetch_waits: bool = True
    # The boundaries' admission rules and L3's mode (policy/admission.py);
    # l2_admission ALWAYS: the write policy's own rule.
    l2_admission: AdmissionRule = ALWAYS
    l3_admission: AdmissionRule = ALWAYS
    l3_mode: L3Mode = L3Mode.INCLUSIVE


@dataclass
class ReplayResult:
    requests: int = 0
    prompt_tokens: int = 0
    l1_tokens: int = 0
    l2_tokens: int = 0
    l3_tokens: int = 0
    # Pages stored to L2 (blocks written across L1 -> L2); objects written
    # to L3 (across L2 -> L3); L3 objects at most.
    stored_pages: int = 0
    l3_written: int = 0
    l3_peak_objects: int = 0
    # Measured only: tokens HiCache held that the server's load gate chose to
    # recompute. The replay has no gate: it counts them as hits.
    declined_tokens: int = 0
    # (L1, L2, L3) hit tokens of each admission.
    per_request: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens + self.l3_tokens

    @property
    def saved_tokens(self) -> int:
        """Prefill tokens HiCache saved: hits beyond vLLM's own cache."""
        return self.l2_tokens + self.l3_tokens

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.rate(self.hit_tokens)
