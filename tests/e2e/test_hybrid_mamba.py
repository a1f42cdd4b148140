"""Mamba hybrids on a real vLLM CPU engine: a GraniteMoeHybrid-like model
whose layers alternate Mamba2 and full attention, so vLLM's hybrid allocator
gives it a Mamba state group (``align`` mode: one state per block boundary,
raw int8 padded pages) and an attention group aliasing the same memory.

Outputs with hits from L2 (after L1 eviction) and from L3 (file backend)
equal recomputation in float32; corrupting the stored Mamba states, or the
stored attention KV, in the host pages changes them (so the loaded state and
the loaded KV are both used).

vLLM's CPU Mamba2 kernel cannot return the intermediate states a prefill
chunk spanning several blocks needs in ``align`` mode (an IndexError in
``mamba_mixer2.conv_ssm_forward``, with or without a connector), so these
engines schedule at most one block per step (``max_num_batched_tokens`` =
the block size). That also makes vLLM keep the state of every block
boundary, so every page of a prompt is stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.engine_utils import BLOCK_SIZE, close, generate, make_llm, scheduler_half

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
# 64 blocks of 32 tokens per group tensor (a page is 16 KiB per layer).
KV_BYTES = 2 << 20
PROMPT_TOKENS = 200  # 6 full blocks
ENGINE_KW = dict(max_num_batched_tokens=BLOCK_SIZE, kv_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def tiny_granite_dir() -> Path:
    from tests.hybrid_models import build_tiny_granite_hybrid

    return build_tiny_granite_hybrid(REPO / ".cache" / "tiny-granite-hybrid")


def prompt_set(seed: int) -> list[list[int]]:
    """Two prompts sharing nothing with other seeds' prompts."""
    return [
        [3 + (i * 37 + seed * 101) % 470 for i in range(PROMPT_TOKENS)],
        [3 + (i * 53 + seed * 67) % 470 for i in range(PROMPT_TOKENS - 45)],
    ]


def filler(seed: int) -> list[list[int]]:
    """Prompts that take every L1 block, evicting what came before."""
    return [[5 + (i * 13 + seed * 7 + k) % 470 for i in range(300)] for k in range(8)]


# Prompt sets: L2 check, Mamba-state control, attention control, L3 check.
SETS = {"l2": 1, "mamba": 2, "full": 3, "l3": 4}


def expected_hit_tokens(prompts) -> list[int]:
    return [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny_granite_dir):
    llm = make_llm(tiny_granite_dir, connector=False, **ENGINE_KW)
    try:
        return {name: generate(llm, prompt_set(seed))[0] for name, seed in SETS.items()}
    finally:
        close(llm)


@pytest.fixture(scope="module")
def engine(tiny_granite_dir, reference, tmp_path_factory):
    """One engine for the module: L2, and L3 in files (reset_connector
    drops L1 and L2 but keeps L3)."""
    l3_dir = tmp_path_factory.mktemp("mamba-l3")
    llm = make_llm(tiny_granite_dir, {
        "hicache_ratio": 4, "hicache_io_backend": "direct", "hicache_mem_layout": "layer_first",
        "hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(l3_dir), "prefetch_threshold": 32},
    }, **ENGINE_KW)
    llm.l3_dir = l3_dir
    yield llm
    close(llm)


def run_then_evict(llm, name: str):
    prompts = prompt_set(SETS[name])
    outputs, cached = generate(llm, prompts)
    assert cached == [0, 0]  # nothing of this set was seen before
    generate(llm, filler(SETS[name]))
    return prompts, outputs


def test_mamba_and_attention_groups_share_pages(engine):
    from tests.e2e.engine_utils import worker_half

    sched = scheduler_half(engine)
    geom = sched.geom
    assert [g.kind for g in geom.groups] == ["mamba", "full"]
    assert geom.block_size == BLOCK_SIZE
    assert sched.cfg.hicache_load_mode == "async"
    # The Mamba layers are viewed over their own raw memory, page for page.
    worker = worker_half()
    mamba_layers = geom.groups[0].layers
    attention = worker.transfer_tensors[geom.groups[1].layers[0]]
    for i in mamba_layers:
        view = worker.transfer_tensors[i]
        assert view.shape == attention.shape and view.dtype == attention.dtype
        assert view[0].numel() * view.element_size() == geom.bytes_per_block // geom.num_layers


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


@pytest.mark.parametrize("group", ["mamba", "full"])
def test_corrupt_group_pages_change_the_output(engine, reference, group):
    """Negative control, per group: the loaded Mamba state (only the last
    page's is loaded) and the loaded attention KV are both used."""
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
