"""Every layout x io backend x write policy x load mode that this machine
really runs, on a real vLLM engine.

Without CUDA the connector rewrites ``kernel`` to ``direct`` and
``page_first`` + ``direct`` to ``page_first_direct`` (config.resolve_conflicts),
so only the distinct resolved pairs are listed, and each case asserts the
layout and copy engine it actually got. For each: greedy outputs equal a run
without HiCache, the repeated prompts hit L2 after vLLM's own prefix cache is
reset, no load error is reported, and every loaded block is bit-identical to
what was stored from L1.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import make_config
from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    ByteAudit,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    worker_half,
)
from vllm_hicache.config import resolve_conflicts

pytestmark = pytest.mark.engine

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
IO_BACKENDS = ["direct", "kernel"]
WRITE_POLICIES = ["write_through", "write_through_selective", "write_back"]
LOAD_MODES = ["layerwise", "async"]




def real_pairs(cuda: bool) -> list[tuple[str, str]]:
    """(layout, io backend) pairs that stay as asked after the rewrites."""
    pairs = []
    for layout, io_backend in itertools.product(LAYOUTS, IO_BACKENDS):
        cfg = resolve_conflicts(make_config(hicache_mem_layout=layout,
                                            hicache_io_backend=io_backend),
                                "" if cuda else "CUDA")
        if (cfg.hicache_mem_layout, cfg.hicache_io_backend) == (layout, io_backend):
            pairs.append((layout, io_backend))
    return pairs


TRANSFER_CLASS = {"direct": "DirectTransfer", "kernel": "KernelTransfer"}


@pytest.mark.parametrize(
    "layout, io_backend, write_policy, load_mode",
    [(*pair, w, m) for pair in real_pairs(torch.cuda.is_available())
     for w, m in itertools.product(WRITE_POLICIES, LOAD_MODES)],
)
def test_outputs_equal_and_l2_hits(tiny_model_dir, reference, layout, io_backend,
                                   write_policy, load_mode):
    extra = dict(hicache_mem_layout=layout, hicache_io_backend=io_backend,
                 hicache_write_policy=write_policy, hicache_load_mode=load_mode)
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, extra)
    try:
        worker, half = worker_half(), scheduler_half(llm)
        # The configuration under test is the one asked for, on both halves.
        assert (half.cfg.hicache_mem_layout, half.cfg.hicache_io_backend) == (layout, io_backend)
        assert worker.pool.layout.name == layout
        assert type(worker.transfer).__name__ == TRANSFER_CLASS[io_backend]
        audit = ByteAudit(worker)
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
        assert half.stats.loaded_blocks > 0
        assert half.stats.load_error_blocks == 0
        assert audit.checked_blocks > 0
        assert audit.mismatches == 0 and audit.unknown_pages == 0
    finally:
        close(llm)


def test_real_pairs_without_cuda_are_the_two_native_ones():
    assert real_pairs(False) == [("layer_first", "direct"), ("page_first_direct", "direct")]
    assert real_pairs(True) == [("layer_first", "direct"), ("layer_first", "kernel"),
                                ("page_first", "kernel"), ("page_first_direct", "direct")]
