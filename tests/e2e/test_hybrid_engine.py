"""Hybrid models on a real vLLM CPU engine: a Gemma3-like model whose layers
alternate sliding-window (64 tokens) and full attention, so vLLM's hybrid
allocator gives it two KV cache groups whose layers alias the same memory.

Outputs with hits from L2 (after L1 eviction) and from L3 (file backend)
equal recomputation in float32; corrupting either group's layers in the
host pages changes them (so both groups' loaded KV is used).
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.engine_utils import BLOCK_SIZE, close, generate, make_llm, scheduler_half

pytestmark = pytest.mark.engine

# Two 32-token blocks per KV cache tensor per group; 64 blocks in all.
KV_BYTES = 2 << 20
PROMPT_TOKENS = 200  # 6 full blocks, most of them outside the 64-token window


def prompt_set(seed: int) -> list[list[int]]:
    """Two prompts sharing nothing with other seeds' prompts."""
    return [
        [3 + (i * 37 + seed * 101) % 470 for i in range(PROMPT_TOKENS)],
        [3 + (i * 53 + seed * 67) % 470 for i in range(PROMPT_TOKENS - 45)],
    ]


def filler(seed: int) -> list[list[int]]:
    """Prompts that take every L1 block, evicting what came before."""
    return [[5 + (i * 13 + seed * 7 + k) % 470 for i in range(300)] for k in range(8)]


# Prompt sets: L2 check, sliding-layer control, full-layer control, L3 check.
SETS = {"l2": 1, "sliding": 2, "full": 3, "l3": 4}


def expected_hit_tokens(prompts) -> list[int]:
    return [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny_gemma3_dir):
    llm = make_llm(tiny_gemma3_dir, connector=False, kv_bytes=KV_BYTES)
    try:
        return {name: generate(llm, prompt_set(seed))[0] for name, seed in SETS.items()}
    finally:
        close(llm)


@pytest.fixture(scope="module")
def engine(tiny_gemma3_dir, reference, tmp_path_factory):
    """One engine for the module: L2, and L3 in files (reset_connector
    drops L1 and L2 but keeps L3)."""
    l3_dir = tmp_path_factory.mktemp("hybrid-l3")
    llm = make_llm(tiny_gemma3_dir, {
        "hicache_ratio": 4, "hicache_io_backend": "direct", "hicache_mem_layout": "layer_first",
        "hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(l3_dir), "prefetch_threshold": 32},
    }, kv_bytes=KV_BYTES)
    llm.l3_dir = l3_dir
    yield llm
    close(llm)


def run_then_evict(llm, name: str):
    prompts = prompt_set(SETS[name])
    outputs, cached = generate(llm, prompts)
    assert cached == [0, 0]  # nothing of this set was seen before
    generate(llm, filler(SETS[name]))
    return prompts, outputs


def test_two_groups_with_aliased_layers(engine):
    sched = scheduler_half(engine)
    kinds = [g.kind for g in sched.geom.groups]
    assert kinds == ["sliding", "full"]
    assert sched.geom.groups[0].sliding_window_tokens == 64
    # Left unset, the load mode becomes async (per-request failure reports).
    assert sched.cfg.hicache_load_mode == "async"


def test_l2_hits_after_l1_eviction_equal_recomputation(engine, reference):
    sched = scheduler_half(engine)
    prompts, first = run_then_evict(engine, "l2")
    assert first == reference["l2"]
    loaded_before = sched.stats.loaded_blocks
    outputs, cached = generate(engine, prompts)
    assert outputs == reference["l2"]
    assert cached == expected_hit_tokens(prompts)
    # The hits came from L2, not from vLLM's own cache.
    assert sched.stats.loaded_blocks - loaded_before == sum(cached) // BLOCK_SIZE
    assert sched.stats.load_error_blocks == 0
    sched.check_integrity()


@pytest.mark.parametrize("group", ["sliding", "full"])
def test_corrupt_group_layers_change_the_output(engine, reference, group):
    """Negative control, per group: the loaded KV of each group is used."""
    from tests.e2e.engine_utils import worker_half

    sched = scheduler_half(engine)
    prompts, first = run_then_evict(engine, group)
    assert first == reference[group]
    layers = next(g.layers for g in sched.geom.groups if g.kind == group)
    cells = worker_half().pool.cells()  # [page, layer, ...]
    generator = torch.Generator().manual_seed(0)
    for layer in layers:
        view = cells[:, layer]
        view.copy_(torch.randn(view.shape, generator=generator, dtype=view.dtype))
    outputs, cached = generate(engine, prompts)
    assert cached == expected_hit_tokens(prompts)
    assert outputs != reference[group]
    # Corrupt pages must not stay hits for the next test; drop L2.
    assert engine.reset_prefix_cache(reset_connector=True)


def test_l3_hits_equal_recomputation(engine, reference):
    sched = scheduler_half(engine)
    prompts = prompt_set(SETS["l3"])
    first, cached = generate(engine, prompts)
    assert first == reference["l3"] and cached == [0, 0]
    # L1 and L2 dropped; the backups reached L3.
    assert engine.reset_prefix_cache(reset_connector=True)
    assert any(engine.l3_dir.rglob("*.hckv"))
    prefetched_before = sched.l3.prefetched_blocks
    outputs, cached = generate(engine, prompts)
    assert outputs == reference["l3"]
    assert cached == expected_hit_tokens(prompts)
    assert sched.l3.prefetched_blocks - prefetched_before == sum(cached) // BLOCK_SIZE
    assert sched.stats.load_error_blocks == 0
