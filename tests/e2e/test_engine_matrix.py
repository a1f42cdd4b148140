"""Every layout x io backend x write policy x load mode on a real vLLM CPU engine.

For each combination: greedy outputs equal a run without HiCache, the
repeated prompts hit L2 after vLLM's own prefix cache is reset, and every
loaded block is bit-identical to what was stored from L1.
"""

from __future__ import annotations

import itertools

import pytest

from tests.e2e.engine_utils import (
    BLOCK_SIZE, ByteAudit, close, generate, make_llm, prompts_with_shared_prefix,
    scheduler_half, worker_half,
)

pytestmark = pytest.mark.engine

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
IO_BACKENDS = ["direct", "kernel"]
WRITE_POLICIES = ["write_through", "write_through_selective", "write_back"]
LOAD_MODES = ["layerwise", "async"]


@pytest.mark.parametrize(
    "layout, io_backend, write_policy, load_mode",
    list(itertools.product(LAYOUTS, IO_BACKENDS, WRITE_POLICIES, LOAD_MODES)),
)
def test_outputs_equal_and_l2_hits(tiny_model_dir, reference, layout, io_backend,
                                   write_policy, load_mode):
    extra = dict(hicache_mem_layout=layout, hicache_io_backend=io_backend,
                 hicache_write_policy=write_policy, hicache_load_mode=load_mode)
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, extra)
    try:
        audit = ByteAudit(worker_half())
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        if write_policy == "write_through_selective":
            outputs, _ = generate(llm, prompts)  # second use -> stored
            assert outputs == reference
        assert llm.reset_prefix_cache()
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        expected = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
        assert cached == expected
        assert scheduler_half(llm).stats.loaded_blocks > 0
        assert audit.checked_blocks > 0 and audit.mismatches == 0
    finally:
        close(llm)
