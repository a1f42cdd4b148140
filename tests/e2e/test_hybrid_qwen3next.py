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
keeps a state only at each chunk's end. Every page is stored with its
attention KV, flagged with whether its state is valid (page_states.py), and
a hit ends at a page with a valid state: the last test checks that a later
turn of a conversation gets from L2, and from L3, the prefix vLLM's own L1
reuses, with the same outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.engine_utils import BLOCK_SIZE, close, make_llm, scheduler_half, worker_half
from tests.e2e.hybrid_checks import (
    check_corrupt_group_changes_output,
    check_l2_hits_after_l1_eviction,
    check_l3_hits_equal_recomputation,
    converse,
    hicache_engine,
    randomize_group,
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
# name: (seed, what is dropped between the turns: nothing, L1, or L1 and L2)
CONVERSATIONS = {"resident": (6, "none"), "evicted": (5, "l1"), "from_l3": (7, "l2")}
CORRUPTED = (8, "l1")  # the negative control's conversation: new to L2 and L3


@pytest.fixture(scope="module")
def tiny_qwen3_next_dir() -> Path:
    from tests.hybrid_models import build_tiny_qwen3_next

    return build_tiny_qwen3_next(REPO / ".cache" / "tiny-qwen3-next")


@pytest.fixture(scope="module")
def reference(tiny_qwen3_next_dir):
    """Outputs without a connector, scheduled as the HiCache engines schedule
    them: in bfloat16 the outputs depend on the chunking (turn 1 differs
    between 32- and 512-token chunks after 3 tokens)."""
    out = reference_outputs(tiny_qwen3_next_dir, SETS, **BLOCK_CHUNKS)
    llm = make_llm(tiny_qwen3_next_dir, connector=False, **WIDE_CHUNKS)
    try:
        # L1 kept: turn 2 reuses turn 1 from vLLM's own cache, so it computes
        # the same chunks as a HiCache engine serving that prefix from L2/L3.
        for name, (seed, _) in {**CONVERSATIONS, "corrupted": CORRUPTED}.items():
            out[name] = converse(llm, seed, evict="none")
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


def test_multi_block_chunks_hit_up_to_the_last_kept_state(engines, reference):
    """Chunks spanning several blocks: every page is stored, a state only at
    each chunk's end, and turn 2 hits turn 1's prefix up to its kept state
    from L1, L2 or L3 alike, with the outputs of vLLM reusing it from L1."""
    llm = engines.get(WIDE_CHUNKS)
    resident = reference["resident"]
    # vLLM alone: each prefill's first chunk stops at the prompt's last block
    # boundary before its end (192 of 200 tokens; 256 of 272), and turn 2
    # reuses turn 1 up to that kept state.
    kept = (len(resident.prompts[0]) - 1) // BLOCK_SIZE
    assert resident.cached2 == kept * BLOCK_SIZE
    for name, (seed, evict) in CONVERSATIONS.items():
        talk = converse(llm, seed, evict)
        assert talk.answers == reference[name].answers, name
        assert talk.cached2 == reference[name].cached2 == kept * BLOCK_SIZE, name
        # Turn 1 stores its 6 full blocks; turn 2 the two it computed.
        assert talk.stored == [list(range(kept)), [kept, kept + 1]], name
    # Negative control: an L2 hit like "evicted", with random states in the
    # host pages.
    talk = converse(llm, *CORRUPTED, between=lambda: randomize_group(worker_half(), "mamba"))
    assert talk.cached2 == kept * BLOCK_SIZE
    assert talk.answers[0] == reference["corrupted"].answers[0]
    assert talk.answers[1] != reference["corrupted"].answers[1]
    assert llm.reset_prefix_cache(reset_connector=True)
