"""Admission rules and exclusive L3 on a real vLLM CPU engine with the file
backend: answers are those vLLM computes without HiCache, and hits come
from the tier the rule says."""

from __future__ import annotations

import pytest

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    KV_BYTES,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    settle_backups,
)
from tests.e2e.test_engine_l3 import expected_hits, l3_extra
from vllm_hicache.common.stats import key, planner_samples

pytestmark = pytest.mark.engine
# vLLM's KV cache is 32 blocks of KV_BYTES / 32 bytes (engine_utils).
PAGE_BYTES = KV_BYTES // 32


def l2_of(pages: int) -> float:
    return (pages + 0.5) * PAGE_BYTES / 1e9


@pytest.mark.parametrize("rules", [
    {"hicache_l2_admission": "hits:2"},
    {"hicache_l3_admission": "hits:2"},
    {"hicache_l3_admission": "value:160"},
])
def test_admission_rules_keep_answers_and_hit_where_the_rule_says(
        tiny_model_dir, reference, tmp_path, rules):
    """Run 1 computes every prompt (each block used once, the shared prefix
    by all three); run 2, L1 forgotten, uses every block a second time;
    run 3, L1 and L2 forgotten, can hit only L3."""
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, {**l3_extra(tmp_path / "l3"), **rules})
    try:
        half = scheduler_half(llm)
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        stored_once = half.stats.stored_blocks
        assert llm.reset_prefix_cache()  # L1 only
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        if "hicache_l2_admission" in rules:
            # Blocks used once were not stored; their second use stores them.
            full_blocks = sum(len(p) // BLOCK_SIZE for p in prompts) - 2 * 2  # prefix shared
            assert stored_once < full_blocks
            assert half.stats.stored_blocks > stored_once
            declined = half.stats.as_samples()[key("admission_declined_blocks", "L2", "hits")]
            assert declined >= full_blocks - stored_once
        else:
            # Declined when stored, admitted by their second use.
            assert half.l3.backups.admission.num_declined > 0
            assert half.l3.backups.admission.num_admitted_later > 0
            rule = rules["hicache_l3_admission"].split(":")[0]
            samples = planner_samples(half.l3)  # what /metrics is fed from
            assert samples[key("admission_declined_blocks", "L3", rule)] == \
                half.l3.backups.admission.num_declined
            assert samples[key("l3_admitted_late_blocks")] == \
                half.l3.backups.admission.num_admitted_later
        generate(llm, [[1] * 40])  # a step or two: the admitted backups go out
        settle_backups(llm)
        assert llm.reset_prefix_cache(reset_connector=True)  # L1 and L2
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        assert half.l3.prefetched_blocks > 0
        assert sum(cached) > 0 and max(cached) <= max(expected_hits(prompts))
        assert half.stats.load_error_blocks == 0
    finally:
        close(llm)


def distinct_prompts(n: int) -> list[list[int]]:
    """``n`` prompts of 4 full blocks and a bit, sharing nothing."""
    return [[3 + (i * 31 + k * 7) % 470 for i in range(4 * BLOCK_SIZE + 9)] for k in range(n)]


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_exclusive_l3_serves_what_l2_evicted(tiny_model_dir, tmp_path, write_policy):
    """L2 of 48 pages (more than L1's 32 blocks, so the in-flight prefetch
    cap, 80% of the difference, fits a prompt), 20 prompts of 4 blocks: the
    first prompts leave L2 (written to L3 as they go), and come back from
    L3 with the answers vLLM computed for them; blocks that never left L2
    were never written."""
    prompts = distinct_prompts(20)
    extra = {**l3_extra(tmp_path / "l3"), "hicache_l3_mode": "exclusive",
             "hicache_size": l2_of(48), "hicache_write_policy": write_policy}
    llm = make_llm(tiny_model_dir, extra)
    try:
        half = scheduler_half(llm)
        first, _ = generate(llm, prompts)
        if write_policy == "write_back":
            assert llm.reset_prefix_cache()  # L1 evicts all: written back to L2
            generate(llm, [[1] * 40])
        assert half.l3.backups.victims.num_backed_up > 0
        assert half.l3.backups.victims.num_backed_up < half.stats.stored_blocks
        settle_backups(llm)  # the victims are in L3 before they are looked up
        assert llm.reset_prefix_cache()  # L1 only: L2 and L3 serve
        again, cached = generate(llm, prompts[:2])
        assert again == first[:2]
        assert half.l3.prefetched_blocks > 0
        samples = planner_samples(half.l3)  # what /metrics is fed from
        assert samples[key("l3_exclusive_blocks", "victim_written")] == \
            half.l3.backups.victims.num_backed_up  # no write budget: every victim admitted went out
        assert samples[key("l3_exclusive_blocks", "promoted")] == half.l3.prefetched_blocks
        assert cached == [4 * BLOCK_SIZE] * 2
        assert half.stats.load_error_blocks == 0
        held = half.l3.backups.l2_only_by_value()
        assert held and len(held) == len(half.l3.backups.victims)
    finally:
        close(llm)
