"""hicache_load_decision=auto on a real vLLM CPU engine: once L3 is measured
slower than the model computes, requests stop waiting for it, and every
answer is still the one vLLM gives without HiCache (recompute vs load)."""

from __future__ import annotations

import uuid

import pytest

from tests.connector import mem_backend
from tests.e2e.engine_utils import (
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
)

pytestmark = pytest.mark.engine

# The tiny model's pages are 16 KiB: 64 ms each at this rate, against about
# a millisecond to compute a block.
SLOW_READ = 256 * 1024


def test_slow_l3_is_recomputed_with_identical_answers(tiny_model_dir, reference):
    store = uuid.uuid4().hex
    extra = {
        "hicache_io_backend": "direct", "hicache_mem_layout": "page_first_direct",
        "hicache_storage_backend": "dynamic", "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {
            "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
            "store": store, "read_bytes_per_s": SLOW_READ, "prefetch_threshold": 32,
        },
    }
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, extra)
    try:
        gate = scheduler_half(llm).load_gate
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        for k in range(4):  # prefill samples: prompts nothing else shares
            generate(llm, [[5 + (i * (k + 3) * 7) % 470 for i in range(300)]])
        for _ in range(4):  # L3 samples: cold, so the requests wait for L3
            assert llm.reset_prefix_cache(reset_connector=True)
            outputs, _ = generate(llm, prompts)
            assert outputs == reference
            if gate.decider.l3.ready:
                break
        assert gate.decider.l3.ready and gate.decider.prefill.ready
        assert gate.decisions[("L3", "loaded")] > 0
        # Measured: L3 is declined, the prompts are recomputed, same answers.
        assert llm.reset_prefix_cache(reset_connector=True)
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        assert gate.decisions.get(("L3", "declined"), 0) > 0
        scheduler_half(llm).check_integrity()
    finally:
        close(llm)
        mem_backend.STORES.pop(store, None)
