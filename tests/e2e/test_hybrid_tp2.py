"""A linear-attention hybrid at TP=2 on vLLM's CPU engine: the tiny
Qwen3-Next-like model of test_hybrid_qwen3next.py with two GDN heads and two
attention KV heads, so each rank holds one of each (its own GDN state and
attention KV in its pages, its own L3 object per page).

The engines run once, in a process of their own (hybrid_tp2_run.py: a TP=2
reference without a connector, then a TP=2 HiCache engine with L2 and file
L3), both with 512-token prefill chunks spanning several 32-token blocks.
vLLM then keeps a GDN state only at each chunk's end; every page is stored
with its attention KV and a flag saying whether its state is valid, and a
hit ends at the last page whose state is valid on every rank. In bfloat16
outputs depend on the chunking, so the reference keeps L1: its turn 2
reuses turn 1 from vLLM's own cache, and computes the chunks a HiCache
engine computes after an L2 or L3 hit of the same length.

Conversations (hybrid_checks.converse): turn 1 is a 200-token prompt (vLLM
keeps the state at 192, its last block boundary before the end); turn 2
re-sends turn 1's prompt and 12-token answer plus a 60-token question (272
tokens; its first chunk ends, and a state is kept, at 256).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.engine_utils import BLOCK_SIZE

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
TURN1_KEPT_BLOCKS = (200 - 1) // BLOCK_SIZE  # 6: the state vLLM keeps at 192
TURN2_KEPT_BLOCKS = (272 - 1) // BLOCK_SIZE  # 8: and at 256


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tests.hybrid_models import build_tiny_qwen3_next_tp2

    model_dir = build_tiny_qwen3_next_tp2(REPO / ".cache" / "tiny-qwen3-next-tp2")
    l3_dir = tmp_path_factory.mktemp("hybrid-tp2") / "l3"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(REPO),
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "tests.e2e.hybrid_tp2_run", str(model_dir),
                          str(l3_dir)], capture_output=True, text=True, env=env,
                         timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-5000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    print(f"hybrid TP=2 engine runs: {time.monotonic() - started:.0f} s")
    return results


def test_each_rank_holds_one_head_of_each_group(runs):
    hicache = runs["hicache"]
    assert hicache["groups"] == ["mamba", "full"]
    assert hicache["block_size"] == BLOCK_SIZE
    # 32 tokens x 1 KV head x 256 x (K, V) x bf16 per layer, two layers (the
    # GDN state padded to the attention page).
    page_bytes = 2 * BLOCK_SIZE * 256 * 2 * 2
    assert hicache["ranks"] == [{"groups": ["mamba", "full"], "kv_heads": 1,
                                 "page_bytes": page_bytes}] * 2
    assert hicache["load_error_blocks"] == 0


def test_l2_hit_after_l1_eviction_matches_vllm_reusing_l1(runs):
    ref, talk = runs["reference"]["evicted"], runs["hicache"]["evicted"]
    assert ref["cached2"] == TURN1_KEPT_BLOCKS * BLOCK_SIZE  # vLLM's own reuse
    assert talk["cached2"] == ref["cached2"]
    assert talk["loaded_blocks"] == TURN1_KEPT_BLOCKS  # from L2, not L1
    assert talk["answers"] == ref["answers"]
    # Turn 1 stores its 6 full blocks (a state only in the last); turn 2 the
    # two it computed.
    assert talk["stored"] == [list(range(TURN1_KEPT_BLOCKS)),
                              [TURN1_KEPT_BLOCKS, TURN1_KEPT_BLOCKS + 1]]


def test_l3_hit_matches_vllm_reusing_l1(runs):
    ref, talk = runs["reference"]["from_l3"], runs["hicache"]["from_l3"]
    assert talk["cached2"] == ref["cached2"] == TURN1_KEPT_BLOCKS * BLOCK_SIZE
    assert talk["prefetched_blocks"] == TURN1_KEPT_BLOCKS  # L1 and L2 were dropped
    assert talk["answers"] == ref["answers"]
    assert talk["shards"] == ["r0", "r1"]  # each rank writes its own objects


def test_l3_hit_ends_at_a_state_every_rank_holds(runs):
    """Turn 2 re-sent from L3 hits up to turn 2's own kept state (256), as
    vLLM reuses it from L1. Then rank 1's object of that page is resealed
    as "no valid state" (it still verifies; rank 0's still says valid): the
    hit ends at the last page valid on both ranks (192), and the answer is
    that of a 192-token hit."""
    ref = runs["reference"]
    resends = runs["hicache"]["from_l3"]["resends"]
    # Turn 2's new pages (blocks 6 and 7), on each rank: a state only in 7.
    assert resends["new_flags"] == {"r0": [False, True], "r1": [False, True]}
    assert ref["resend"]["cached"] == TURN2_KEPT_BLOCKS * BLOCK_SIZE
    assert resends["as_stored"] == ref["resend"]
    assert resends["flipped"] == 1
    assert resends["one_rank_without_state"] == {
        "answer": ref["from_l3"]["answers"][1], "cached": TURN1_KEPT_BLOCKS * BLOCK_SIZE}


@pytest.mark.parametrize("rank", [0, 1])
def test_random_states_in_one_ranks_host_pages_change_the_output(runs, rank):
    """Negative control: the same L2 hit (L1 dropped) after random bytes went
    into the GDN state layers of every host page of one rank's worker
    (through collective_rpc): turn 2's answer changes, so each rank's loaded
    state is used."""
    name = f"corrupted_r{rank}"
    ref, talk = runs["reference"][name], runs["hicache"][name]
    assert talk["cached2"] == ref["cached2"] == TURN1_KEPT_BLOCKS * BLOCK_SIZE
    assert talk["loaded_blocks"] == TURN1_KEPT_BLOCKS
    assert talk["answers"][0] == ref["answers"][0]
    assert talk["answers"][1] != ref["answers"][1]
