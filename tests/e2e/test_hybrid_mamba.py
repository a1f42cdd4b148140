"""Mamba hybrids on a real vLLM CPU engine: a GraniteMoeHybrid-like model
whose layers alternate Mamba2 and full attention, so vLLM's hybrid allocator
gives it a Mamba state group (``align`` mode: one state per block boundary,
raw int8 padded pages) and an attention group aliasing the same memory.

Outputs with hits from L2 (after L1 eviction) and from L3 (file backend)
equal recomputation in float32; corrupting the stored Mamba states, or the
stored attention KV, in the host pages changes them (so the loaded state and
the loaded KV are both used).

vLLM's CPU Mamba2 kernel cannot return the intermediate states a prefill
chunk spanning several blocks needs in ``align`` mode (an IndexError in
``mamba_mixer2.conv_ssm_forward``, with or without a connector), so these
engines schedule at most one block per step (``max_num_batched_tokens`` =
the block size). That also makes vLLM keep the state of every block
boundary, so every page of a prompt is stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.engine_utils import BLOCK_SIZE, close, scheduler_half
from tests.e2e.hybrid_checks import (
    check_corrupt_group_changes_output,
    check_l2_hits_after_l1_eviction,
    check_l3_hits_equal_recomputation,
    hicache_engine,
    reference_outputs,
)

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
# 64 blocks of 32 tokens per group tensor (a page is 16 KiB per layer).
KV_BYTES = 2 << 20
ENGINE_KW = dict(max_num_batched_tokens=BLOCK_SIZE, kv_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def tiny_granite_dir() -> Path:
    from tests.hybrid_models import build_tiny_granite_hybrid

    return build_tiny_granite_hybrid(REPO / ".cache" / "tiny-granite-hybrid")


# Prompt sets: L2 check, Mamba-state control, attention control, L3 check.
SETS = {"l2": 1, "mamba": 2, "full": 3, "l3": 4}


@pytest.fixture(scope="module")
def reference(tiny_granite_dir):
    return reference_outputs(tiny_granite_dir, SETS, **ENGINE_KW)


@pytest.fixture(scope="module")
def engine(tiny_granite_dir, reference, tmp_path_factory):
    llm = hicache_engine(tiny_granite_dir, tmp_path_factory.mktemp("mamba-l3"), **ENGINE_KW)
    yield llm
    close(llm)


def test_mamba_and_attention_groups_share_pages(engine):
    from tests.e2e.engine_utils import worker_half

    sched = scheduler_half(engine)
    geom = sched.geom
    assert [g.kind for g in geom.groups] == ["mamba", "full"]
    assert geom.block_size == BLOCK_SIZE
    assert sched.cfg.hicache_load_mode == "async"
    # The Mamba layers are viewed over their own raw memory, page for page.
    worker = worker_half()
    mamba_layers = geom.groups[0].layers
    attention = worker.transfer_tensors[geom.groups[1].layers[0]]
    for i in mamba_layers:
        view = worker.transfer_tensors[i]
        assert view.shape == attention.shape and view.dtype == attention.dtype
        assert view[0].numel() * view.element_size() == geom.bytes_per_block // geom.num_layers


def test_l2_hits_after_l1_eviction_equal_recomputation(engine, reference):
    check_l2_hits_after_l1_eviction(engine, reference["l2"], SETS["l2"])


@pytest.mark.parametrize("group", ["mamba", "full"])
def test_corrupt_group_pages_change_the_output(engine, reference, group):
    """Negative control, per group: the loaded Mamba state (only the last
    page's is loaded) and the loaded attention KV are both used."""
    check_corrupt_group_changes_output(engine, reference[group], group, SETS[group])


def test_l3_hits_equal_recomputation(engine, reference):
    check_l3_hits_equal_recomputation(engine, reference["l3"], SETS["l3"])
