"""GroupedTransfer: each (group block id, page) pair copies only its group's
layers, between that group's block and the page; other layers and blocks are
left alone. CPU, direct copies; no vLLM."""

import torch

from vllm_hicache.datapath import GroupedTransfer
from vllm_hicache.datapath.grouped import copy_bytes
from vllm_hicache.host import HostKVPool
from vllm_hicache.kernels import describe_kv_tensor, make_transfer

NUM_BLOCKS, BLOCK, HEADS, HEAD = 6, 4, 2, 8


def setup():
    # Two groups of two layers; layer i of group 0 aliases layer i of group 1
    # (one tensor per position, as vLLM's hybrid allocator lays them out).
    # CPU_ATTN's layout: [blocks, heads, block_size, 2 * head_size].
    shared = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for _ in range(2)]
    tensors = [shared[0], shared[1], shared[0], shared[1]]
    layouts = [describe_kv_tensor(t, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                                  num_kv_heads=HEADS, head_size=HEAD, is_mla=False,
                                  backend_name="CPU_ATTN") for t in tensors]
    pool = HostKVPool.for_layouts(5, layouts, "layer_first", pin_memory=False)
    inner = make_transfer("direct", tensors, layouts, pool)
    return shared, pool, GroupedTransfer(inner, [range(0, 2), range(2, 4)], NUM_BLOCKS)


def test_store_then_load_moves_each_group_with_its_own_blocks():
    shared, pool, transfer = setup()
    original = [t.clone() for t in shared]
    # Page 3 <- group 0's block 1 and group 1's block 4.
    transfer.store([1, NUM_BLOCKS + 4], [3, 3])
    page = pool.read_pages([3])[0]  # [layer, planes, block, heads, head]
    assert not torch.equal(page[0], page[2])  # different blocks of one tensor
    for t in shared:
        t.zero_()
    # Only group 1 back, into block 2: group 0's layers of the page stay in the pool.
    transfer.load([NUM_BLOCKS + 2], [3])
    for layer in range(2):
        assert torch.equal(shared[layer][2], original[layer][4])
        assert not shared[layer][1].any()
    transfer.load_layer(0, [1, NUM_BLOCKS + 5], [3, 3])  # layer 0 is group 0's
    assert torch.equal(shared[0][1], original[0][1])
    assert not shared[1][1].any()  # layer 1 (group 0) not asked for
    assert not shared[0][5].any()  # group 1's pair skipped by a group 0 layer
    transfer.load([1], [3])
    assert torch.equal(shared[1][1], original[1][1])


def test_copy_bytes_counts_each_pair_as_its_groups_share_of_a_page():
    _, pool, transfer = setup()
    page = pool.bytes_per_page
    # Two groups of two layers each: a pair moves half a page.
    assert copy_bytes(transfer, [1, NUM_BLOCKS + 4], page) == page
    assert copy_bytes(transfer, [NUM_BLOCKS + 2], page) == page // 2
    assert copy_bytes(transfer.inner, [1, 2, 3], page) == 3 * page  # one group: whole pages
    uneven = GroupedTransfer(transfer.inner, [range(0, 1), range(1, 4)], NUM_BLOCKS)
    assert copy_bytes(uneven, [0, NUM_BLOCKS], page) == page // 4 + page * 3 // 4
