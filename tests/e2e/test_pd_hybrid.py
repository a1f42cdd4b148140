"""Prefill/decode disaggregation of a hybrid model: a tiny Gemma3-like model
(sliding-window layers, 64 tokens, next to full-attention layers: vLLM's
hybrid allocator gives it two KV cache groups), float32, through the
topology and checks of test_pd.py (pd_topology.py); the module takes about
2 minutes on 2 busy cores.

What the hybrid case adds: NixlConnector hands decode one block list per
group, and a host page holds every group's KV of one block position, so a
position is stored only while every group holds it. Turn 1's prompt (100
tokens) is longer than the window: decode receives it with block 0 already
out of the sliding group's window (vLLM gives that position its null block
there), so decode stores blocks 1 and 2 of the prompt but not block 0, which
prefill stored when it computed it; as decode generates (171 tokens), the
window moves on, and decode must store blocks 3 and 4 in the steps that
complete them. Turn 2 (192 tokens) finds blocks 0..4 across prefill's
caches and L3; blocks 3 and 4, decode's alone, come from L3, and the tokens
computed after them attend to them in both groups' layers.

The model has untied embeddings: with Gemma3's tied ones this tiny model
repeats one token whatever the context (hybrid_models.py), so neither the
equality with the reference nor the negative control would say anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.pd_topology import (
    BLOCK,
    Workload,
    check_decode_only_offloads,
    check_decode_written_kv_is_used,
    check_second_turn_prefill_loads_decode_writes,
    check_two_turns_match_one_instance,
    page_bytes,
    run_pd_topology,
)
from tests.e2e.test_serve import TEST_ARGS, metric_value
from tests.hybrid_models import GEMMA3_SLIDING_WINDOW

pytestmark = pytest.mark.engine

# The two groups share vLLM's KV memory: 1 MiB (the tiny Llama's) holds 480
# tokens of this model, less than a 512-token request; 2 MiB is 64 blocks.
KV_BYTES = 2 << 20
# Turn 1's prompt ends past the 64-token window; blocks 3 and 4 are decode's
# (a 72-token answer: the geometry test_decode_stores_only_... counts on).
WORKLOAD = Workload(turn1_tokens=100, turn1_max_tokens=72)


def serve_args() -> list[str]:
    args = list(TEST_ARGS)
    args[args.index("--kv-cache-memory-bytes") + 1] = str(KV_BYTES)
    return args


@pytest.fixture(scope="module")
def gemma3_dir(tiny_gemma3_dir) -> Path:
    return tiny_gemma3_dir


@pytest.fixture(scope="module")
def pd(gemma3_dir, tmp_path_factory):
    return run_pd_topology(gemma3_dir, tmp_path_factory.mktemp("pd-gemma3"), serve_args(),
                           page_bytes(gemma3_dir, dtype_bytes=4), WORKLOAD)


def test_both_sides_serve_two_groups(pd):
    """vLLM's hybrid allocator stayed on with MultiConnector (it turns it off
    for a connector without HMA support: one group, nothing hybrid left)."""
    for name in ("prefill", "decode", "bad_decode"):
        starts = [line for line in pd.logs[name].splitlines() if "HiCache: L1 " in line]
        assert len(starts) == 1, pd.logs[name][-4000:]
        assert " groups=sliding(64 tokens)x2+fullx2;" in starts[0], starts[0]


def test_decode_stores_only_positions_every_group_holds(pd):
    """Decode received turn 1's 100-token prompt with block 0 already out of
    the sliding window: it stored blocks 1..4 in turn 1 and block 5 (the
    first full one past them) in turn 2, never block 0, whose sliding-layer
    KV it did not have. Its L2 (128 pages, nothing evicted) holds exactly
    those pages.

    Where decode computed turn 1's prompt itself (vLLM's count of its
    locally computed prompt tokens says so: prefill's KV did not reach it,
    seen once in CI under load), it held block 0 in every group and stored
    it rightly; the count then includes it, and the premise is named."""
    # vLLM frees sliding blocks before token (computed - window + 1); decode
    # starts from the prompt less its last token.
    first_in_window = (WORKLOAD.turn1_tokens - 1 - GEMMA3_SLIDING_WINDOW + 1) // BLOCK
    turn2_full_blocks = (len(pd.conv.turn2) + WORKLOAD.turn2_max_tokens - 1) // BLOCK
    assert first_in_window == 1 and turn2_full_blocks == 6
    received = pd.conv.decode_computed1 <= 1  # the last token at most
    assert received or pd.conv.decode_computed1 == WORKLOAD.turn1_tokens, (
        pd.conv.decode_computed1, pd.logs["decode"][-4000:])
    first_stored = first_in_window if received else 0
    assert metric_value(pd.decode_metrics, "vllm:hicache_l2_pages_used") == (
        turn2_full_blocks - first_stored), (
        f"decode computed {pd.conv.decode_computed1:g} of turn 1's prompt tokens itself",
        pd.logs["decode"][-4000:])


def test_two_turns_through_the_router_match_one_instance(pd):
    check_two_turns_match_one_instance(pd)


def test_second_turn_prefill_loads_what_decode_wrote_to_l3(pd):
    check_second_turn_prefill_loads_decode_writes(pd)


def test_decode_only_offloads(pd):
    check_decode_only_offloads(pd)


def test_negative_control_decode_written_kv_is_used(pd):
    check_decode_written_kv_is_used(pd)
