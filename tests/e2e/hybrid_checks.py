"""Checks shared by the hybrid-model engine tests (test_hybrid_engine.py:
sliding window + full; test_hybrid_mamba.py: Mamba2 + full;
test_hybrid_qwen3next.py: Gated DeltaNet + full).

Each module runs one reference engine (no connector) and one HiCache engine
(L2, and L3 in files) on its model, over prompt sets named in its ``SETS``
(``{"l2": seed, <group kind>: seed, ..., "l3": seed}``), and calls these.
The two-turn conversations (``converse``) serve the Mamba / linear-attention
modules with multi-block prefill chunks (test_hybrid_qwen3next.py at TP=1,
test_hybrid_tp2.py at TP=2).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    scheduler_half,
    settle_backups,
    worker_half,
)

PROMPT_TOKENS = 200  # 6 full blocks (most outside a 64-token sliding window)
# A conversation's second-turn question, after turn 1's prompt and answer.
QUESTION = [7 + (i * 29) % 470 for i in range(60)]


def prompt_set(seed: int) -> list[list[int]]:
    """Two prompts sharing nothing with other seeds' prompts."""
    return [
        [3 + (i * 37 + seed * 101) % 470 for i in range(PROMPT_TOKENS)],
        [3 + (i * 53 + seed * 67) % 470 for i in range(PROMPT_TOKENS - 45)],
    ]


def filler(seed: int) -> list[list[int]]:
    """Prompts that take every L1 block, evicting what came before."""
    return [[5 + (i * 13 + seed * 7 + k) % 470 for i in range(300)] for k in range(8)]


def expected_hit_tokens(prompts) -> list[int]:
    return [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]


def reference_outputs(model_dir, sets: dict[str, int], **engine_kw) -> dict[str, list]:
    llm = make_llm(model_dir, connector=False, **engine_kw)
    try:
        return {name: generate(llm, prompt_set(seed))[0] for name, seed in sets.items()}
    finally:
        close(llm)


def hicache_engine(model_dir, l3_dir, **engine_kw):
    """L2, and L3 in files (reset_connector drops L1 and L2 but keeps L3)."""
    llm = make_llm(model_dir, {
        "hicache_ratio": 4, "hicache_io_backend": "direct", "hicache_mem_layout": "layer_first",
        "hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(l3_dir), "prefetch_threshold": 32},
    }, **engine_kw)
    llm.l3_dir = l3_dir
    return llm


def run_then_evict(llm, seed: int):
    prompts = prompt_set(seed)
    outputs, cached = generate(llm, prompts)
    assert cached == [0, 0]  # nothing of this set was seen before
    generate(llm, filler(seed))
    return prompts, outputs


def check_l2_hits_after_l1_eviction(engine, expected, seed: int) -> None:
    sched = scheduler_half(engine)
    prompts, first = run_then_evict(engine, seed)
    assert first == expected
    loaded_before = sched.stats.loaded_blocks
    outputs, cached = generate(engine, prompts)
    assert outputs == expected
    assert cached == expected_hit_tokens(prompts)
    # The hits came from L2, not from vLLM's own cache.
    assert sched.stats.loaded_blocks - loaded_before == sum(cached) // BLOCK_SIZE
    assert sched.stats.load_error_blocks == 0
    sched.check_integrity()


def check_corrupt_group_changes_output(engine, expected, group: str, seed: int) -> None:
    """Negative control: random bytes in one group's layers of every host
    page change the output, so that group's loaded data is used."""
    prompts, first = run_then_evict(engine, seed)
    assert first == expected
    randomize_group(worker_half(), group)
    outputs, cached = generate(engine, prompts)
    assert cached == expected_hit_tokens(prompts)
    assert outputs != expected
    # Corrupt pages must not stay hits for the next test; drop L2.
    assert engine.reset_prefix_cache(reset_connector=True)


def check_l3_hits_equal_recomputation(engine, expected, seed: int) -> None:
    sched = scheduler_half(engine)
    prompts = prompt_set(seed)
    first, cached = generate(engine, prompts)
    assert first == expected and cached == [0, 0]
    # L1 and L2 dropped once the backups reached L3.
    settle_backups(engine)
    assert engine.reset_prefix_cache(reset_connector=True)
    assert any(engine.l3_dir.rglob("*.hckv"))
    prefetched_before = sched.l3.prefetched_blocks
    outputs, cached = generate(engine, prompts)
    assert outputs == expected
    assert cached == expected_hit_tokens(prompts)
    assert sched.l3.prefetched_blocks - prefetched_before == sum(cached) // BLOCK_SIZE
    assert sched.stats.load_error_blocks == 0


def randomize_group(worker, kind: str) -> None:
    """Random bytes in the layers of group ``kind`` of every host page of one
    worker half (this process's, or a TP worker's through collective_rpc)."""
    layers = next(g.layers for g in worker.geom.groups if g.kind == kind)
    cells = worker.pool.cells()  # [page, layer, ...]
    generator = torch.Generator().manual_seed(0)
    for layer in layers:
        view = cells[:, layer]
        view.copy_(torch.randn(view.shape, generator=generator, dtype=view.dtype))


@dataclass
class Conversation:
    """Turn 1 (a 200-token prompt), then turn 2 re-sending turn 1's prompt and
    answer plus a 60-token question."""

    prompts: list[list[int]]
    answers: list[list[int]]
    cached2: int  # turn 2's cached tokens
    stored: list[list[int]]  # per turn, block positions stored (HiCache engines)


def converse(llm, seed: int, evict: str,
             between: Callable[[], None] | None = None) -> Conversation:
    """``evict``: "l1" fills L1 between the turns, so turn 2 can hit only L2;
    "l2" also drops L2 (once turn 1's backups are acknowledged), so turn
    2 can hit only L3. ``between`` runs last before turn 2 (dropping caches
    another way, a negative control's corruption)."""
    has_connector = llm.llm_engine.vllm_config.kv_transfer_config is not None
    sched = scheduler_half(llm) if has_connector else None
    turn1 = prompt_set(seed)[0]
    with stored_positions(sched) as stored1:
        (answer1,), _ = generate(llm, [turn1])
    if evict != "none":
        generate(llm, filler(seed))
    if evict == "l2":
        settle_backups(llm)
        assert llm.reset_prefix_cache(reset_connector=True)
    if between is not None:
        between()
    turn2 = turn1 + answer1 + QUESTION
    with stored_positions(sched) as stored2:
        (answer2,), (cached2,) = generate(llm, [turn2])
    return Conversation([turn1, turn2], [answer1, answer2], cached2, [stored1, stored2])


@contextmanager
def stored_positions(sched):
    """Block positions the scheduler half indexes as stored pages meanwhile
    (none without a connector)."""
    from vllm_hicache.common.page_ops import OpKind

    seen: list[int] = []
    if sched is None:
        yield seen
        return
    stores = sched.stores
    insert = stores.insert_pinned

    def spy(kind, chain, blocks, pages, *args, **kwargs):
        if kind is OpKind.STORE:
            seen.extend(blocks)
        return insert(kind, chain, blocks, pages, *args, **kwargs)

    stores.insert_pinned = spy
    try:
        yield seen
    finally:
        del stores.insert_pinned  # the class's method again
