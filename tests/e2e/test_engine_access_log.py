"""The capacity planner against a real engine: a multi-turn workload whose
working set outgrows L1 and L2 runs with L2, an L3 file store and the access
log on; replaying the log at the served sizes predicts the hit rate the
engine measured (vLLM's num_cached_tokens), tier by tier."""

from __future__ import annotations

import random

import pytest

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    scheduler_half,
    settle_backups,
)
from vllm_hicache.planner.log_format import Admit, read_logs
from vllm_hicache.planner.report import CostModel, build_plan

pytestmark = pytest.mark.engine

# 16 conversations of up to 8 blocks (128) against L1 = 31 blocks, L2 = 64
# pages (L3 prefetches may use 0.8 x (64 - 32) of them), L3 unlimited.
CONVERSATIONS, TURNS, BATCH = 16, 4, 4
L2_PAGES = 64
# The tiny model's KV: one block of all layers.
PAGE_BYTES = 32768
# Replay vs engine, in hit-rate points.
TOLERANCE = 0.03


def run_workload(llm) -> tuple[int, int]:
    """Turns of every conversation in shuffled batches; (prompt, cached) tokens."""
    rng = random.Random(0)
    system = [3 + (i * 37) % 470 for i in range(64)]
    convs = [system + [5 + (i * (c + 2) * 13) % 470 for i in range(40)]
             for c in range(CONVERSATIONS)]
    prompt_tokens = cached_tokens = 0
    for turn in range(TURNS):
        order = list(range(CONVERSATIONS))
        rng.shuffle(order)
        for k in range(0, CONVERSATIONS, BATCH):
            batch = order[k : k + BATCH]
            outs, cached = generate(llm, [convs[c] for c in batch], max_tokens=12)
            settle_backups(llm)  # the replay's L3 has every backup at once
            prompt_tokens += sum(len(convs[c]) for c in batch)
            cached_tokens += sum(cached)
            for c, out in zip(batch, outs):
                user = [7 + (i * (turn + 3) * (c + 1)) % 470 for i in range(40)]
                convs[c] = convs[c] + out + user
    return prompt_tokens, cached_tokens


def _tiers(res) -> str:
    return (f"{res.hit_rate:.3f} (L1 {res.rate(res.l1_tokens):.3f}, "
            f"L2 {res.rate(res.l2_tokens):.3f}, L3 {res.rate(res.l3_tokens):.3f})")


def test_replay_predicts_the_hit_rate_the_engine_measured(tiny_model_dir, tmp_path):
    log_path = tmp_path / "access.log"
    extra = {
        "hicache_io_backend": "direct",
        "hicache_mem_layout": "page_first_direct",
        "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(tmp_path / "l3"),
                                                 "prefetch_threshold": BLOCK_SIZE},
        "hicache_size": (L2_PAGES + 0.5) * PAGE_BYTES / 1e9,
        "hicache_access_log": str(log_path),
        # The replay models the tiers, not the load gate: under "auto" the gate
        # may decline L3 hits once its estimates say the tiny model recomputes
        # them faster (seen as a batch of 4 declined hits, 512 tokens, in about
        # one run in three after other engines had run in the process).
        "hicache_load_decision": "always",
    }
    llm = make_llm(tiny_model_dir, extra)
    try:
        assert scheduler_half(llm).num_pages == L2_PAGES
        prompt_tokens, cached_tokens = run_workload(llm)
        half = scheduler_half(llm)
        decisions = (dict(half.load_gate.decisions), half.l3.prefetch_not_worth,
                     half.l3.prefetch_revoked, half.l3.prefetch_timed_out)
    finally:
        close(llm)  # flushes the log
    log = read_logs([log_path])
    assert log.num_dropped == 0 and not log.truncated_files
    assert log.header.block_size == BLOCK_SIZE and log.header.l2_pages == L2_PAGES

    plan = build_plan(log, CostModel(), l2_gb=[], l3_gb=[])
    measured, predicted = plan.measured, plan.served.result
    engine_rate = cached_tokens / prompt_tokens
    differ = [(i, m, p) for i, (m, p) in enumerate(zip(measured.per_request,
                                                        predicted.per_request)) if m != p]
    tiers = (f"engine hit {engine_rate:.3f}; log {_tiers(measured)}; replay {_tiers(predicted)}"
             f"; (request, logged, replayed) where they differ: {differ}; "
             f"gate decisions, not worth, revoked, timed out: {decisions}")
    # The log says what the engine measured, request by request.
    assert measured.requests == CONVERSATIONS * TURNS == sum(
        isinstance(r, Admit) for r in log.records)
    assert (measured.prompt_tokens, measured.hit_tokens) == (prompt_tokens, cached_tokens)
    # The workload uses every tier.
    assert min(measured.l1_tokens, measured.l2_tokens, measured.l3_tokens) > 0, tiers
    # The replay predicts it: L1 exactly (vLLM's prefix cache is simulated
    # block by block), the whole within a few points.
    assert predicted.l1_tokens == measured.l1_tokens, tiers
    assert abs(predicted.hit_rate - engine_rate) <= TOLERANCE, tiers
    assert abs(predicted.rate(predicted.saved_tokens) - measured.rate(measured.saved_tokens)) \
        <= TOLERANCE, tiers
