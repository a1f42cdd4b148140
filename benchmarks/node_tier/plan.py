"""What the node-tier benchmark runs, as data: sizes in pages, the prompts,
which instance serves which request, and the ratios it reports.

Sizes are in pages (one vLLM block of every layer, ``page_bytes``) so that
one plan fits any model: S, the node tier, is ``node_pages``; the working
set (``docs`` documents of ``doc_blocks`` blocks each) fits S but not S/3,
which ``Plan.check`` enforces, along with an L1 too small to hold what
comes back to an instance. Pure: no torch, no vLLM.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_hicache.policy.prefetch import prefetch_inflight_cap

BLOCK_TOKENS = 32
FIRST_WORD_ID = 3
NUM_WORDS = 470
# A question plus its answer stays inside the document's last, partial
# block, so the stored pages are the documents' and nothing else.
QUESTION_TOKENS = 16
ANSWER_TOKENS = 8
INSTANCES = 3
# The node tier's segment adds headers and alignment to its pages.
NODE_HEADROOM_BYTES = 1 << 20


@dataclass(frozen=True)
class Plan:
    page_bytes: int
    l1_blocks: int = 32
    doc_blocks: int = 24
    docs: int = 9
    node_pages: int = 288
    # Each node-tier instance's private L2 (the staging area of the current
    # load path), as a multiple of L1 (hicache_ratio must be > 1): a node-tier
    # hit is prefetched into it, at most ``staging_prefetch_pages`` at once.
    staging_ratio: float = 2.0
    rounds: int = 5
    ttft_trials: int = 24
    seed: int = 0

    @property
    def working_set_pages(self) -> int:
        return self.docs * self.doc_blocks

    @property
    def max_model_len(self) -> int:
        return (self.doc_blocks + 2) * BLOCK_TOKENS

    @property
    def staging_pages(self) -> int:
        return int(self.l1_blocks * self.staging_ratio)

    @property
    def staging_prefetch_pages(self) -> int:
        return prefetch_inflight_cap(self.staging_pages, self.l1_blocks)

    @property
    def node_tier_bytes(self) -> int:
        return self.node_pages * self.page_bytes + NODE_HEADROOM_BYTES

    def private_l2_gb(self, pages: int) -> float:
        """``hicache_size`` (GB of 1e9 bytes) holding ``pages`` pages."""
        return pages * self.page_bytes / 1e9

    def check(self) -> None:
        """ValueError naming the size that breaks the comparison."""
        ws, s = self.working_set_pages, self.node_pages
        if not s // INSTANCES < ws <= s:
            raise ValueError(f"the working set ({ws} pages) must fit S ({s} pages) but not "
                             f"S/3 ({s // INSTANCES} pages)")
        if self.l1_blocks < self.doc_blocks + 2:
            raise ValueError(f"l1_blocks={self.l1_blocks} cannot hold one request "
                             f"({self.doc_blocks + 2} blocks)")
        # A document comes back to an instance after every other document
        # passed through it: an L1 that held them would hide the tiers.
        if self.l1_blocks >= ws - self.doc_blocks:
            raise ValueError(f"l1_blocks={self.l1_blocks} holds the rest of the working set "
                             f"({ws - self.doc_blocks} pages): the hits would be L1's")
        if self.staging_prefetch_pages < self.doc_blocks:
            raise ValueError(f"staging_ratio={self.staging_ratio} lets a prefetch hold "
                             f"{self.staging_prefetch_pages} pages, fewer than a document's "
                             f"{self.doc_blocks}: node-tier hits would be cut short")
        if self.rounds < 2 or self.ttft_trials < 1:
            raise ValueError("rounds must be >= 2 (one cold, one reused) and ttft_trials >= 1")


def quick(page_bytes: int) -> Plan:
    """A smoke run: the same shape, fewer documents, rounds and trials."""
    return Plan(page_bytes=page_bytes, docs=6, rounds=2, ttft_trials=2)


def words(rng: random.Random, n: int) -> list[int]:
    return [FIRST_WORD_ID + rng.randrange(NUM_WORDS) for _ in range(n)]


def documents(plan: Plan, salt: str) -> list[list[int]]:
    rng = random.Random(f"{plan.seed}/{salt}")
    return [words(rng, plan.doc_blocks * BLOCK_TOKENS) for _ in range(plan.docs)]


def question(plan: Plan, *where: object) -> list[int]:
    """A fresh question, the same for the same ``where`` in every configuration."""
    return words(random.Random(f"{plan.seed}/q/{where}"), QUESTION_TOKENS)


def rotation(plan: Plan) -> list[tuple[int, int, int]]:
    """(round, document, instance) in the order asked: every round asks each
    document once, on the instance after the one that last served it."""
    return [(r, d, (r + d) % INSTANCES) for r in range(plan.rounds) for d in range(plan.docs)]


def reusable_tokens(prompt_len: int) -> int:
    """Tokens of a prompt's prefix a cache can serve: its full blocks, the
    last token always computed."""
    return (prompt_len - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def hit_rate(served: list[dict]) -> tuple[int, int]:
    """(hit tokens, reusable tokens) over the requests after the first round;
    ``served`` rows carry ``round``, ``prompt_len`` and ``cached``."""
    later = [s for s in served if s["round"] > 0]
    reusable = sum(reusable_tokens(s["prompt_len"]) for s in later)
    return sum(min(s["cached"], reusable_tokens(s["prompt_len"])) for s in later), reusable


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
