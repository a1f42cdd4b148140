"""Prefetch policies: how long a request may wait for its L3 -> L2 prefetch.

Named as SGLang's ``--hicache-storage-prefetch-policy``:

- best_effort: never waits; the request runs with whatever L2 holds when it
  is scheduled, and a prefetch still running helps later requests only.
- wait_complete: waits until the prefetch ends, but never past
  ``prefetch_timeout_max`` (a stuck store must not stall a request).
- timeout: waits until the prefetch ends or its budget runs out:
  ``prefetch_timeout_base + prefetch_timeout_per_ki_token x tokens / 1024``,
  capped by ``prefetch_timeout_max``.

Which L3 hits are fetched at all (``prefetch_threshold``): ``auto`` (the
default) fetches a hit of any length that the load decision's cost model
(policy/load.py: lookup latency plus bytes over the measured bandwidth,
against the prefill time of those tokens) expects to arrive sooner than
vLLM would compute it; an integer fetches only hits of at least that many
tokens, whatever they cost (SGLang's fixed threshold). A fixed 256 tokens
recomputes every short hit, the decode-only tail of a PD answer included,
even where loading it is cheaper.

Pure module: the L3 planner asks it, and keeps the lookups and deadlines.
"""

from __future__ import annotations

from enum import StrEnum


class PrefetchPolicyName(StrEnum):
    """hicache_storage_prefetch_policy's values (a str: compares and prints as its name)."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


PREFETCH_POLICIES = tuple(PrefetchPolicyName)
# prefetch_threshold's value that lets the cost model decide.
PREFETCH_THRESHOLD_AUTO = "auto"


def parse_prefetch_threshold(value: object) -> int | str:
    """``"auto"``, or a number of tokens >= 1."""
    if value == PREFETCH_THRESHOLD_AUTO:
        return PREFETCH_THRESHOLD_AUTO
    if (isinstance(value, (int, float)) and not isinstance(value, bool)
            and float(value).is_integer() and value >= 1):
        return int(value)
    raise ValueError(f"expected {PREFETCH_THRESHOLD_AUTO!r} (the cost model decides) or "
                     "a number of tokens >= 1")


def min_prefetch_blocks(threshold: int | str, block_size: int) -> int:
    """Fewest blocks a hit needs to be fetched: a fixed threshold rounded up
    to whole blocks; one block under ``auto`` (the cost model decides the rest)."""
    if threshold == PREFETCH_THRESHOLD_AUTO:
        return 1
    assert isinstance(threshold, int), threshold
    return max(1, -(-threshold // block_size))
# Share of the L2 pages beyond L1 that prefetches in flight may hold
# (SGLang's cap): the rest keeps serving hits and stores meanwhile.
PREFETCH_L2_SHARE = 0.8


def prefetch_inflight_cap(l2_pages: int, l1_blocks: int) -> int:
    """L2 pages prefetches may hold at once, at least one."""
    return max(1, int(PREFETCH_L2_SHARE * (l2_pages - l1_blocks)))


class PrefetchPolicy:
    """Asked by the L3 planner when a lookup starts (``wait_budget_s``) and
    each time vLLM offers the request a slot (``should_wait``)."""

    def __init__(self, name: str, timeout_base_s: float, timeout_per_ki_token_s: float,
                 timeout_max_s: float) -> None:
        if name not in PREFETCH_POLICIES:
            raise ValueError(f"unknown hicache_storage_prefetch_policy {name!r}; "
                             f"accepted: {', '.join(PREFETCH_POLICIES)}")
        self.name = name
        self.timeout_base_s = timeout_base_s
        self.timeout_per_ki_token_s = timeout_per_ki_token_s
        self.timeout_max_s = timeout_max_s

    @property
    def ever_waits(self) -> bool:
        return self.name != PrefetchPolicyName.BEST_EFFORT

    def wait_budget_s(self, num_tokens: int) -> float:
        """Longest wait for a prefetch of ``num_tokens`` tokens."""
        if self.name == PrefetchPolicyName.BEST_EFFORT:
            return 0.0
        if self.name == PrefetchPolicyName.WAIT_COMPLETE:
            return self.timeout_max_s
        wait = self.timeout_base_s + self.timeout_per_ki_token_s * num_tokens / 1024
        return min(wait, self.timeout_max_s)

    def should_wait(self, prefetch_over: bool, now: float, deadline: float) -> bool:
        """Keep the request waiting? ``prefetch_over``: the lookup missed or
        the prefetch ended, one way or another."""
        return self.ever_waits and not prefetch_over and now <= deadline
