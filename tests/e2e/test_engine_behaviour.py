"""HiCache on a real vLLM CPU engine: hits after L1 eviction, reset, the
negative control, and bad input failing at start."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    worker_half,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_model_dir, reference):
    """One engine for the module: layer_first, write_through, layerwise.

    Depends on ``reference`` so that engine (without a connector) runs first:
    vLLM keeps the worker-side connector in a process-wide global."""
    engine = make_llm(tiny_model_dir, {"hicache_io_backend": "direct", "hicache_ratio": 4})
    yield engine
    close(engine)


def distinct_prompt(seed: int, num_tokens: int) -> list[int]:
    return [3 + (seed * 97 + i * 29) % 470 for i in range(num_tokens)]


def test_hit_after_l1_eviction_without_reset(llm):
    first = distinct_prompt(1, 200)
    reference, _ = generate(llm, [first])
    # 32 L1 blocks; 6 x 7 blocks of other prompts push `first` out of L1.
    for seed in range(2, 8):
        generate(llm, [distinct_prompt(seed, 220)])
    loaded_before = scheduler_half(llm).stats.loaded_blocks
    again, cached = generate(llm, [first])
    assert again == reference
    assert cached == [(200 - 1) // BLOCK_SIZE * BLOCK_SIZE]
    assert scheduler_half(llm).stats.loaded_blocks > loaded_before
    assert scheduler_half(llm).stats.load_error_blocks == 0


def test_reset_connector_clears_l2(llm):
    prompts = prompts_with_shared_prefix()
    generate(llm, prompts)
    assert llm.reset_prefix_cache(reset_connector=True)
    assert scheduler_half(llm).tree.num_cached_pages == 0
    loaded_before = scheduler_half(llm).stats.loaded_blocks
    _, cached = generate(llm, prompts[:1])
    assert cached == [0]
    assert scheduler_half(llm).stats.loaded_blocks == loaded_before


def test_negative_control_corrupt_host_pages_change_output(llm, reference):
    """If L2 bytes were not really used, corrupting them would change nothing."""
    prompts = prompts_with_shared_prefix()
    llm.reset_prefix_cache(reset_connector=True)
    outputs, _ = generate(llm, prompts)
    assert outputs == reference
    pool = worker_half().pool
    gen = torch.Generator().manual_seed(0)
    buf = pool.buffer
    buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float32).to(buf.dtype) * 10)
    assert llm.reset_prefix_cache()
    corrupted, cached = generate(llm, prompts)
    assert sum(cached) > 0
    assert corrupted != reference
    llm.reset_prefix_cache(reset_connector=True)  # leave a clean cache behind


def test_bad_config_fails_at_start_naming_the_key(tiny_model_dir):
    with pytest.raises(Exception, match="hicache_ratio"):
        make_llm(tiny_model_dir, {"hicache_ratio": 0.5})
    with pytest.raises(Exception, match="hicache_write_polcy"):
        make_llm(tiny_model_dir, {"hicache_write_polcy": "write_back"})


def test_host_pool_too_large_fails_before_allocating(tiny_model_dir):
    with pytest.raises(Exception, match="does not fit: MemAvailable"):
        make_llm(tiny_model_dir, {"hicache_size": 100_000})
