"""L1 <-> L2 copies, every mem_layout x io backend x L1 layout.

Roundtrip: store blocks into pages, load the pages into *different* blocks,
compare bit for bit. Sources stay unchanged and blocks/pages not named in a
call keep their old bytes. Ids mix runs and singles, in odd counts. The
``kernel`` backend runs its Triton kernels in the CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_factory import make_kv_layers, random_bits, same_bits
from vllm_hicache.host import MEM_LAYOUTS, HostKVPool
from vllm_hicache.kernels import DirectTransfer, KernelTransfer, describe_kv_tensor
from vllm_hicache.kernels import direct as direct_module

NB, NP, L, BLOCK, H, D = 12, 13, 3, 4, 2, 8
# (backend, vLLM physical layout, heads, content, is_mla)
L1_CASES = {
    "cpu": ("CPU_ATTN", "LBHNC", H, 2 * D, False),
    "fa_nhd": ("FLASH_ATTN", "LBNHC", H, 2 * D, False),
    "fa_head_outer": ("FLASH_ATTN", "LHBNC", H, 2 * D, False),
    "fi_block_outer": ("FLASHINFER", "BLNHC", H, 2 * D, False),
    "mla": ("FLASHMLA", "LBNHC", 1, 3 * D, True),
    # vLLM's kernel-block split: each block is 2 kernel blocks of BLOCK // 2.
    "fa_split": ("FLASH_ATTN", "LBNHC", H, 2 * D, False),
}
KERNEL_BLOCKS = {"fa_split": 2}
SRC_BLOCKS = [3, 4, 5, 9, 0]
PAGES = [7, 8, 2, 11, 12]
DST_BLOCKS = [10, 1, 2, 6, 8]


def build(case: str, mem_layout: str, stacked: bool = True):
    backend, order, heads, content, mla = L1_CASES[case]
    split = KERNEL_BLOCKS.get(case, 1)
    layers = make_kv_layers(order, num_layers=L, num_blocks=NB * split, heads=heads,
                            tokens=BLOCK // split, content=content, stacked=stacked)
    head_size = content if mla else content // 2
    layouts = [
        describe_kv_tensor(t, num_blocks=NB, block_size=BLOCK, num_kv_heads=heads,
                          head_size=head_size, is_mla=mla, backend_name=backend)
        for t in layers
    ]
    pool = HostKVPool.for_layouts(NP, layouts, mem_layout)
    assert pool.canonical_page_shape == (L, layouts[0].planes, BLOCK, heads, head_size)
    noise = random_bits(pool.buffer.numel(), torch.bfloat16, seed=99)
    pool.buffer.copy_(noise.view_as(pool.buffer))
    return layers, layouts, pool


def make(io_backend, layers, layouts, pool, request):
    if io_backend == "direct":
        return DirectTransfer(layers, layouts, pool)
    request.getfixturevalue("interpreted_triton")
    return KernelTransfer(layers, layouts, pool)


def by_block(tensor):
    """Index L1 rows by manager block (kernel blocks grouped)."""
    return tensor.unflatten(0, (NB, -1))


def canonical(layouts, layers, blocks):
    """[n, layers, planes, block_size, heads, head_size] of L1 blocks."""
    return torch.stack([lay.semantic_view(t)[blocks] for lay, t in zip(layouts, layers)], dim=1)


@pytest.mark.parametrize("stacked", [True, False], ids=["one_alloc", "per_layer_alloc"])
@pytest.mark.parametrize("case", sorted(L1_CASES))
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_store_then_load_into_other_blocks(mem_layout, io_backend, case, stacked, request):
    layers, layouts, pool = build(case, mem_layout, stacked)
    transfer = make(io_backend, layers, layouts, pool, request)
    l1_before = [t.clone() for t in layers]
    others = [p for p in range(NP) if p not in PAGES]
    pages_before = pool.read_pages(others)

    transfer.store(SRC_BLOCKS, PAGES)
    transfer.synchronize()
    assert all(same_bits(t, old) for t, old in zip(layers, l1_before)), "store wrote to L1"
    assert same_bits(pool.read_pages(PAGES), canonical(layouts, layers, SRC_BLOCKS))
    assert same_bits(pool.read_pages(others), pages_before)

    transfer.load(DST_BLOCKS, PAGES)
    transfer.synchronize()
    untouched = [b for b in range(NB) if b not in DST_BLOCKS]
    for t, old in zip(layers, l1_before):
        t, old = by_block(t), by_block(old)
        assert same_bits(t[DST_BLOCKS], old[SRC_BLOCKS])
        assert same_bits(t[untouched], old[untouched])


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_load_layer_writes_only_that_layer(mem_layout, io_backend, request):
    layers, layouts, pool = build("fa_nhd", mem_layout)
    transfer = make(io_backend, layers, layouts, pool, request)
    transfer.store(SRC_BLOCKS, PAGES)
    before = [t.clone() for t in layers]
    transfer.load_layer(1, DST_BLOCKS, PAGES)
    transfer.wait_layer(1)
    assert same_bits(layers[1][DST_BLOCKS], before[1][SRC_BLOCKS])
    assert same_bits(layers[0], before[0]) and same_bits(layers[2], before[2])


@pytest.mark.parametrize("min_run_bytes", [0, 1 << 40], ids=["runs", "index"])
@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_direct_runs_and_index_paths_agree(mem_layout, min_run_bytes, monkeypatch):
    monkeypatch.setattr(direct_module, "MIN_RUN_BYTES", min_run_bytes)
    layers, layouts, pool = build("cpu", mem_layout, stacked=False)
    transfer = DirectTransfer(layers, layouts, pool)
    pair = transfer._all_pairs[0]
    runs = [(b, p, 1) for b, p in zip(SRC_BLOCKS, PAGES)]
    assert transfer._use_index(pair, runs, len(runs)) == bool(min_run_bytes)
    before = [t.clone() for t in layers]
    transfer.store(SRC_BLOCKS, PAGES)
    transfer.load(DST_BLOCKS, PAGES)
    assert all(same_bits(t[DST_BLOCKS], old[SRC_BLOCKS]) for t, old in zip(layers, before))


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_empty_call_is_a_no_op(io_backend, request):
    layers, layouts, pool = build("fa_nhd", "layer_first")
    transfer = make(io_backend, layers, layouts, pool, request)
    before = pool.buffer.clone()
    transfer.store([], [])
    transfer.load([], [])
    assert same_bits(pool.buffer, before)


def test_out_of_range_ids_are_refused():
    layers, layouts, pool = build("fa_nhd", "page_first")
    transfer = DirectTransfer(layers, layouts, pool)
    with pytest.raises(AssertionError):
        transfer.store([NB], [0])
    with pytest.raises(AssertionError):
        transfer.load([0], [NP])


def test_pool_that_does_not_match_is_refused():
    layers, layouts, _ = build("fa_head_outer", "layer_first")
    # A canonical-order pool cannot hold head-outer native rows.
    pool = HostKVPool(NP, L, 2, BLOCK, H, D, torch.bfloat16, "layer_first")
    with pytest.raises(ValueError, match="native order"):
        DirectTransfer(layers, layouts, pool)
    pool = HostKVPool(NP, L + 1, 2, BLOCK, H, D, torch.bfloat16, "page_first")
    with pytest.raises(ValueError, match="pool layers"):
        DirectTransfer(layers, layouts, pool)


@pytest.mark.parametrize("item_bytes,unit", [(2, 2), (8 * 4097, 8), (6, 1), (4 * 8191, 4)])
def test_copy_items_kernel_matches_torch(item_bytes, unit, interpreted_triton):
    src = random_bits(3 * item_bytes + 64, torch.int8, seed=5)
    dst = torch.zeros(3 * item_bytes + 64, dtype=torch.int8)
    starts_src, starts_dst = [0, 2 * item_bytes, item_bytes], [item_bytes, 0, 2 * item_bytes]
    table = torch.tensor(
        [[src.data_ptr() + s for s in starts_src], [dst.data_ptr() + s for s in starts_dst]]
    )
    interpreted_triton.copy_items(table[0], table[1], item_bytes, unit)
    expected = torch.zeros_like(dst)
    for s, d in zip(starts_src, starts_dst):
        expected[d : d + item_bytes] = src[s : s + item_bytes]
    assert torch.equal(dst, expected)


def test_cuda_plan_uses_dma_friendly_slices():
    """On CUDA a copy_ is one DMA only for contiguous views (checked on CPU)."""
    from types import SimpleNamespace

    from vllm_hicache.kernels.direct import memcpy_rows, memcpy_runs
    from vllm_hicache.kernels.plan import Run

    layers, layouts, pool = build("fa_nhd", "layer_first")
    transfer = DirectTransfer(layers, layouts, pool)
    assert all(memcpy_runs(p) for pairs in transfer._layer_pairs for p in pairs)
    layers, layouts, pool = build("fa_head_outer", "layer_first")
    transfer = DirectTransfer(layers, layouts, pool)
    pair = transfer._layer_pairs[0][0]
    assert memcpy_rows(pair) and not memcpy_runs(pair)
    transfer._tracker = SimpleNamespace(is_async=True)
    assert transfer._dma_runs(pair, [Run(2, 5, 3)]) == [Run(2, 5, 1), Run(3, 6, 1), Run(4, 7, 1)]
