"""L3 with every write policy x load mode, on both payload paths (layer_first
stages pages; page_first_direct moves them zero-copy): after L1 and L2 are
dropped, the prompts come back from L3 with outputs equal to the reference."""

from __future__ import annotations

import itertools

import pytest

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    settle_backups,
)

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    "layout, write_policy, load_mode",
    list(itertools.product(["layer_first", "page_first_direct"],
                           ["write_through", "write_through_selective", "write_back"],
                           ["layerwise", "async"])),
)
def test_l3_round_trip(tiny_model_dir, reference, tmp_path, layout, write_policy, load_mode):
    extra = {
        "hicache_io_backend": "direct", "hicache_mem_layout": layout,
        "hicache_write_policy": write_policy, "hicache_load_mode": load_mode,
        "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(tmp_path / "l3"),
                                                 "prefetch_threshold": 32},
    }
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, extra)
    try:
        assert generate(llm, prompts)[0] == reference
        if write_policy == "write_through_selective":
            assert generate(llm, prompts)[0] == reference  # the second use stores
        assert llm.reset_prefix_cache()  # write_back: L1 -> L2 (and L3) now
        assert generate(llm, prompts)[0] == reference
        settle_backups(llm)
        assert llm.reset_prefix_cache(reset_connector=True)
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        assert cached == [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
        assert scheduler_half(llm).l3.prefetched_blocks > 0
        assert scheduler_half(llm).stats.load_error_blocks == 0
    finally:
        close(llm)
