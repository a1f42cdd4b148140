"""Which block positions of a Mamba hybrid the scheduler half stores, and
where their state is valid: every position whose attention KV exists is
stored; its state part is copied (and flagged valid) only where the Mamba
group's block holds the state of the prefix ending at that position's
boundary once the step's forward ran; a hit ends at a page with a valid
state."""

from types import SimpleNamespace

import torch
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from tests.conftest import make_config
from tests.connector.test_geometry import kv_config
from vllm_hicache.connector.geometry import geometry_from
from vllm_hicache.scheduler.request_state import ReqState
from vllm_hicache.scheduler.scheduler import HiCacheScheduler

BLOCK = 32
FULL = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
MAMBA = MambaSpec(block_size=BLOCK, shapes=((3, 160),), dtypes=(torch.float32,),
                  page_size_padded=FULL.page_size_bytes, mamba_cache_mode="align")
HASHES = [bytes([i]) * 8 for i in range(6)]


class FakePool:
    """vLLM's block pool as far as the hash check reads it."""

    def __init__(self, num_blocks: int = 16):
        self.null_block = SimpleNamespace(block_id=0)
        self.blocks = [SimpleNamespace(block_hash=None, block_hash_num_tokens=None)
                       for _ in range(num_blocks)]

    def key(self, block_id: int, position: int, group: int = 0) -> None:
        self.blocks[block_id].block_hash = make_block_hash_with_group_id(HASHES[position], group)
        self.blocks[block_id].block_hash_num_tokens = (position + 1) * BLOCK


def scheduler_and_state(mamba_ids: list[int]):
    sched = HiCacheScheduler(make_config(hicache_ratio=2),
                             geometry_from(kv_config(MAMBA, FULL, num_blocks=16)))
    pool = FakePool()
    sched._groups.bind(pool)
    request = SimpleNamespace(block_hashes=HASHES, request_id="r", priority=0)
    state = ReqState(request, group_block_ids=[list(mamba_ids), [10, 11, 12, 13, 14, 15]])
    return sched, pool, state


def test_state_where_the_forward_ends_on_the_boundary():
    # A chunk [96, 128): the state is written into position 3's block.
    sched, _, state = scheduler_and_state([0, 0, 0, 5])
    assert sched._groups.holds_states(state, 3, done_tokens=4 * BLOCK)
    # The same block after a forward ending past the boundary is the running
    # state of a later token, not this boundary's.
    assert not sched._groups.holds_states(state, 3, done_tokens=4 * BLOCK + 7)
    # Null positions hold no state.
    assert not sched._groups.holds_states(state, 2, done_tokens=3 * BLOCK)


def test_state_of_an_earlier_position_only_where_vllm_keys_it():
    # A forward ending inside position 4 with a prefill checkpoint at
    # position 3 (vLLM keys its block by position 3's prefix hash).
    sched, pool, state = scheduler_and_state([0, 0, 6, 5, 7])
    done = 4 * BLOCK + 20
    assert not sched._groups.holds_states(state, 3, done)
    pool.key(5, 3)
    assert sched._groups.holds_states(state, 3, done)
    # Our table names block 6 at position 2, but vLLM freed it and keyed it
    # for another prefix (or for another group): not stored.
    pool.key(6, 4)
    assert not sched._groups.holds_states(state, 2, done)
    pool.blocks[6].block_hash = make_block_hash_with_group_id(HASHES[2], 1)
    assert not sched._groups.holds_states(state, 2, done)


def test_store_range_stores_attention_everywhere_and_states_where_kept():
    sched, pool, state = scheduler_and_state([0, 0, 0, 5, 7])
    pool.key(5, 3)
    pairs = sched.stores.store_range(state, 0, 5, done_tokens=4 * BLOCK + 20, step=0)
    by_page: dict[int, list[int]] = {}
    for p in pairs:
        by_page.setdefault(p.page, []).append(p.block_id)
    # One page per position, each with its attention block (group 1: 16 + id);
    # the Mamba block only at position 3 (kept by vLLM): block 7 at position
    # 4 is the running state of token 148, not a boundary's.
    assert sorted(sorted(b) for b in by_page.values()) == sorted([
        [16 + 10], [16 + 11], [16 + 12], [5, 16 + 13], [16 + 14]])
    matched = sched.tree.match(HASHES[:5]).pages
    assert [sched.page_states.valid(p) for p in matched] == [False, False, False, True, False]
    # A hit ends on the last page with a valid state.
    assert sched.page_states.usable(matched) == 4
    assert sched.page_states.usable(matched[:3]) == 0


def test_lookup_cuts_the_hit_at_the_last_kept_state():
    sched, pool, state = scheduler_and_state([0, 0, 0, 5, 7])
    pool.key(5, 3)
    sched.stores.store_range(state, 0, 5, done_tokens=4 * BLOCK + 20, step=0)
    request = SimpleNamespace(block_hashes=HASHES[:5] + [b"x" * 8], request_id="q",
                              priority=0, num_tokens=6 * BLOCK)
    tokens, _ = sched.get_num_new_matched_tokens(request, 0)
    assert tokens == 4 * BLOCK
