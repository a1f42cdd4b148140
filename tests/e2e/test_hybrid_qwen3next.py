"""Qwen3-Next hybrids on a real vLLM CPU engine: a tiny Qwen3-Next-like model
(one Gated DeltaNet linear-attention layer, one full-attention layer, sparse
MoE blocks), so vLLM's hybrid allocator gives it a linear-attention state
group (``align`` mode, raw int8 padded pages) and an attention group.

bfloat16, not float32: vLLM's CPU GDN kernel refuses anything else
("CPU GDN attention requires BF16"). Greedy outputs are still exact here:
a hit loads the very bytes the forward wrote, and the reference engine runs
the same chunks (in bfloat16, 32- and 512-token chunks give different
outputs, so the reference must chunk as the engine under test does).

With ``max_num_batched_tokens`` = the block size (32) every prefill chunk
ends on a block boundary, so every page of a prompt is stored: outputs with
hits from L2 (after L1 eviction) and from L3 (file backend) equal
recomputation, and corrupting the stored states, or the stored attention KV,
changes them.

Unlike the Mamba2 kernel, the CPU GDN kernel runs prefill chunks spanning
several blocks. vLLM's ``align`` scheduling then cuts a prompt's prefill at
its last block boundary before the end (``(len - 1) // block * block``) and
keeps a state only at each chunk's end, so a multi-block chunk stores one
page (its last) and no prefix starting at block 0: the last test records
that a later turn of a conversation gets no hit from L2 although vLLM's own
L1 reuses the earlier turn's prefix.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.engine_utils import BLOCK_SIZE, close, generate, make_llm, scheduler_half
from tests.e2e.hybrid_checks import (
    check_corrupt_group_changes_output,
    check_l2_hits_after_l1_eviction,
    check_l3_hits_equal_recomputation,
    filler,
    hicache_engine,
    prompt_set,
    reference_outputs,
)

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
# 64 blocks of 32 tokens per group tensor (a page is 32 KiB per layer).
KV_BYTES = 2 << 20
ENGINE_KW = dict(dtype="bfloat16", kv_bytes=KV_BYTES)
# One block per step: every prefill chunk ends on a block boundary.
BLOCK_CHUNKS = dict(ENGINE_KW, max_num_batched_tokens=BLOCK_SIZE)
# Whole prompts per step: chunks span several blocks.
WIDE_CHUNKS = dict(ENGINE_KW, max_num_batched_tokens=512)

# Prompt sets: L2 check, state control, attention control, L3 check, and the
# two conversations of the multi-block test.
SETS = {"l2": 1, "mamba": 2, "full": 3, "l3": 4}
CONVERSATIONS = {"evicted": (5, True), "resident": (6, False)}  # name: (seed, evict L1)
QUESTION = [7 + (i * 29) % 470 for i in range(60)]


@pytest.fixture(scope="module")
def tiny_qwen3_next_dir() -> Path:
    from tests.hybrid_models import build_tiny_qwen3_next

    return build_tiny_qwen3_next(REPO / ".cache" / "tiny-qwen3-next")


@dataclass
class Conversation:
    """Turn 1 (a 200-token prompt), then turn 2 re-sending turn 1's prompt and
    answer plus a 60-token question."""

    prompts: list[list[int]]
    answers: list[list[int]]
    cached2: int  # turn 2's cached tokens
    stored: list[list[int]]  # per turn, block positions stored (HiCache engines)


def converse(llm, seed: int, evict: bool) -> Conversation:
    """``evict``: fill L1 between the turns, so turn 2 can hit only L2."""
    has_connector = llm.llm_engine.vllm_config.kv_transfer_config is not None
    sched = scheduler_half(llm) if has_connector else None
    turn1 = prompt_set(seed)[0]
    with stored_positions(sched) as stored1:
        (answer1,), _ = generate(llm, [turn1])
    if evict:
        generate(llm, filler(seed))
    turn2 = turn1 + answer1 + QUESTION
    with stored_positions(sched) as stored2:
        (answer2,), (cached2,) = generate(llm, [turn2])
    return Conversation([turn1, turn2], [answer1, answer2], cached2, [stored1, stored2])


@contextmanager
def stored_positions(sched):
    """Block positions the scheduler half indexes as stored pages meanwhile
    (none without a connector)."""
    from vllm_hicache.connector.page_ops import OpKind

    seen: list[int] = []
    if sched is None:
        yield seen
        return
    insert = sched._insert_pinned

    def spy(kind, chain, blocks, pages, *args, **kwargs):
        if kind is OpKind.STORE:
            seen.extend(blocks)
        return insert(kind, chain, blocks, pages, *args, **kwargs)

    sched._insert_pinned = spy
    try:
        yield seen
    finally:
        del sched._insert_pinned  # the class's method again


@pytest.fixture(scope="module")
def reference(tiny_qwen3_next_dir):
    """Outputs without a connector, scheduled as the HiCache engines schedule
    them: in bfloat16 the outputs depend on the chunking (turn 1 differs
    between 32- and 512-token chunks after 3 tokens)."""
    out = reference_outputs(tiny_qwen3_next_dir, SETS, **BLOCK_CHUNKS)
    llm = make_llm(tiny_qwen3_next_dir, connector=False, **WIDE_CHUNKS)
    try:
        for name, (seed, evict) in CONVERSATIONS.items():
            out[name] = converse(llm, seed, evict=evict).answers
        return out
    finally:
        close(llm)


class OneEngine:
    """The module's HiCache engine, started per chunking on first use. One at a
    time: vLLM keeps the worker connector in a process-wide global."""

    def __init__(self, model_dir, l3_root) -> None:
        self.model_dir, self.l3_root = model_dir, l3_root
        self.kw: dict | None = None
        self.llm = None

    def get(self, kw: dict):
        if self.kw != kw:
            self.close()
            l3_dir = self.l3_root / f"chunk{kw['max_num_batched_tokens']}"
            self.llm, self.kw = hicache_engine(self.model_dir, l3_dir, **kw), kw
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            llm, self.llm, self.kw = self.llm, None, None
            close(llm)


@pytest.fixture(scope="module")
def engines(tiny_qwen3_next_dir, reference, tmp_path_factory):
    one = OneEngine(tiny_qwen3_next_dir, tmp_path_factory.mktemp("qwen3next-l3"))
    yield one
    one.close()


@pytest.fixture
def engine(engines):
    return engines.get(BLOCK_CHUNKS)


def test_linear_attention_and_attention_groups_share_pages(engine):
    from tests.e2e.engine_utils import worker_half

    sched = scheduler_half(engine)
    geom = sched.geom
    assert [g.kind for g in geom.groups] == ["mamba", "full"]
    assert geom.block_size == BLOCK_SIZE
    assert sched.cfg.hicache_load_mode == "async"
    worker = worker_half()
    state_layer = worker.transfer_tensors[geom.groups[0].layers[0]]
    attention = worker.transfer_tensors[geom.groups[1].layers[0]]
    assert state_layer.shape == attention.shape and state_layer.dtype == attention.dtype


def test_l2_hits_after_l1_eviction_equal_recomputation(engine, reference):
    check_l2_hits_after_l1_eviction(engine, reference["l2"], SETS["l2"])


@pytest.mark.parametrize("group", ["mamba", "full"])
def test_corrupt_group_pages_change_the_output(engine, reference, group):
    """Negative control, per group: the loaded GDN state (only the last
    page's is loaded) and the loaded attention KV are both used."""
    check_corrupt_group_changes_output(engine, reference[group], group, SETS[group])


def test_l3_hits_equal_recomputation(engine, reference):
    check_l3_hits_equal_recomputation(engine, reference["l3"], SETS["l3"])


def test_multi_block_chunks_store_chunk_ends_only(engines, reference):
    """Chunks spanning several blocks: outputs still equal recomputation, but
    only each chunk's last page has a state, so it alone is stored and L2
    offers no prefix (a hit starts at block 0). vLLM's own L1 does reuse turn
    1's prefix up to its kept state: what per-page state validity could
    serve from L2/L3 too."""
    llm = engines.get(WIDE_CHUNKS)

    evicted = converse(llm, *CONVERSATIONS["evicted"])
    assert evicted.answers == reference["evicted"]
    # Each prefill's first chunk stops at the prompt's last block boundary
    # before its end (192 of 200 tokens; 256 of 272); the second chunk and
    # the 12 decode steps end on no boundary. Only that page is stored.
    last_boundary = [(len(p) - 1) // BLOCK_SIZE for p in evicted.prompts]
    assert evicted.stored == [[last_boundary[0] - 1], [last_boundary[1] - 1]]
    assert evicted.cached2 == 0

    # L1 kept: vLLM reuses turn 1 up to its kept state (192 tokens).
    resident = converse(llm, *CONVERSATIONS["resident"])
    assert resident.answers == reference["resident"]
    assert resident.cached2 == last_boundary[0] * BLOCK_SIZE
