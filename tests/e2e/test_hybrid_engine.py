"""Hybrid models on a real vLLM CPU engine: a Gemma3-like model whose layers
alternate sliding-window (64 tokens) and full attention, so vLLM's hybrid
allocator gives it two KV cache groups whose layers alias the same memory.

Outputs with hits from L2 (after L1 eviction) and from L3 (file backend)
equal recomputation in float32; corrupting either group's layers in the
host pages changes them (so both groups' loaded KV is used).
"""

from __future__ import annotations

import pytest

from tests.e2e.engine_utils import close, scheduler_half
from tests.e2e.hybrid_checks import (
    check_corrupt_group_changes_output,
    check_l2_hits_after_l1_eviction,
    check_l3_hits_equal_recomputation,
    hicache_engine,
    reference_outputs,
)

pytestmark = pytest.mark.engine

# Two 32-token blocks per KV cache tensor per group; 64 blocks in all.
KV_BYTES = 2 << 20

# Prompt sets: L2 check, sliding-layer control, full-layer control, L3 check.
SETS = {"l2": 1, "sliding": 2, "full": 3, "l3": 4}


@pytest.fixture(scope="module")
def reference(tiny_gemma3_dir):
    return reference_outputs(tiny_gemma3_dir, SETS, kv_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def engine(tiny_gemma3_dir, reference, tmp_path_factory):
    llm = hicache_engine(tiny_gemma3_dir, tmp_path_factory.mktemp("hybrid-l3"), kv_bytes=KV_BYTES)
    yield llm
    close(llm)


def test_two_groups_with_aliased_layers(engine):
    sched = scheduler_half(engine)
    kinds = [g.kind for g in sched.geom.groups]
    assert kinds == ["sliding", "full"]
    assert sched.geom.groups[0].sliding_window_tokens == 64
    # Left unset, the load mode becomes async (per-request failure reports).
    assert sched.cfg.hicache_load_mode == "async"


def test_l2_hits_after_l1_eviction_equal_recomputation(engine, reference):
    check_l2_hits_after_l1_eviction(engine, reference["l2"], SETS["l2"])


@pytest.mark.parametrize("group", ["sliding", "full"])
def test_corrupt_group_layers_change_the_output(engine, reference, group):
    """Negative control, per group: the loaded KV of each group is used."""
    check_corrupt_group_changes_output(engine, reference[group], group, SETS[group])


def test_l3_hits_equal_recomputation(engine, reference):
    check_l3_hits_equal_recomputation(engine, reference["l3"], SETS["l3"])
