"""Checks shared by the hybrid-model engine tests (test_hybrid_engine.py:
sliding window + full; test_hybrid_mamba.py: Mamba2 + full;
test_hybrid_qwen3next.py: Gated DeltaNet + full).

Each module runs one reference engine (no connector) and one HiCache engine
(L2, and L3 in files) on its model, over prompt sets named in its ``SETS``
(``{"l2": seed, <group kind>: seed, ..., "l3": seed}``), and calls these.
"""

from __future__ import annotations

import torch

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    scheduler_half,
    worker_half,
)

PROMPT_TOKENS = 200  # 6 full blocks (most outside a 64-token sliding window)


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
    sched = scheduler_half(engine)
    prompts, first = run_then_evict(engine, seed)
    assert first == expected
    layers = next(g.layers for g in sched.geom.groups if g.kind == group)
    cells = worker_half().pool.cells()  # [page, layer, ...]
    generator = torch.Generator().manual_seed(0)
    for layer in layers:
        view = cells[:, layer]
        view.copy_(torch.randn(view.shape, generator=generator, dtype=view.dtype))
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
    # L1 and L2 dropped; the backups reached L3.
    assert engine.reset_prefix_cache(reset_connector=True)
    assert any(engine.l3_dir.rglob("*.hckv"))
    prefetched_before = sched.l3.prefetched_blocks
    outputs, cached = generate(engine, prompts)
    assert outputs == expected
    assert cached == expected_hit_tokens(prompts)
    assert sched.l3.prefetched_blocks - prefetched_before == sum(cached) // BLOCK_SIZE
    assert sched.stats.load_error_blocks == 0
