"""The crash that opened the hardening work, on a real engine: a small L2
under eviction pressure, an L3 whose puts are slow (a user backend through
``dynamic``), and several new requests per step. Before the fix EngineCore
died in build_connector_meta ("cannot lock 6 blocks: the tree holds only 0
of this chain") for every eviction policy. Now: no crash, the answers of
the run without HiCache, no load error, and the scheduler half intact."""

from __future__ import annotations

import pytest

from tests.e2e.engine_utils import KV_BYTES, close, generate, make_llm, scheduler_half
from vllm_hicache.policy import EVICTION_POLICIES

pytestmark = pytest.mark.engine


def prompts(salt: int = 0) -> list[list[int]]:
    """24 prompts, half of them sharing a block-long prefix, lengths not
    block-aligned; each ``salt`` a new set. Over 100 distinct blocks for an
    L1 of 16 blocks and an L2 of 32 pages."""
    prefixes = [[3 + (i * k * 29) % 470 for i in range(32 + 32 * k)] for k in range(1, 5)]
    return [prefixes[j % 4][: 32 * (j % 2)]
            + [5 + (i * (j + 2) * 13 + j + 7 * salt) % 470 for i in range(100 + 3 * j)]
            for j in range(24)]


@pytest.fixture(scope="module")
def reference_slow(tiny_model_dir):
    llm = make_llm(tiny_model_dir, connector=False, max_num_seqs=8, kv_bytes=KV_BYTES // 2,
                   max_model_len=320)
    try:
        return [generate(llm, prompts(r))[0] for r in range(4)]
    finally:
        close(llm)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_slow_l3_under_l2_pressure_never_crashes(tiny_model_dir, reference_slow, policy):
    extra = {
        "hicache_io_backend": "direct",
        "hicache_ratio": 2,
        "radix_eviction_policy": policy,
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": {
            "module_path": "tests.storage.user_backend", "class_name": "SlowPutBackend",
            "put_delay_s": 0.2, "prefetch_threshold": 32,
        },
    }
    llm = make_llm(tiny_model_dir, extra, max_num_seqs=8, kv_bytes=KV_BYTES // 2, max_model_len=320)
    try:
        half = scheduler_half(llm)
        assert half.cfg.radix_eviction_policy == policy and half.l3 is not None
        for r in range(4):
            outputs, _ = generate(llm, prompts(r))
            assert outputs == reference_slow[r]
            half.check_integrity()
        assert half.stats.evicted_pages > 0, "L2 was never under pressure"
        assert half.stats.store_skipped_blocks > 0, "every page could be stored: no pins bit"
        assert half.stats.load_error_blocks == 0
    finally:
        close(llm)
