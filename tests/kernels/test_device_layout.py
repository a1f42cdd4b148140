"""DeviceKVLayout: semantic addressing and segments of every L1 layout.

Tensors are torch.arange-filled so that each element names its own offset:
an addressing mistake shows up as a wrong number, not a coincidence.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_factory import STRIDE_ORDERS, strided_5d
from vllm_hicache.kernels.device_layout import describe_kv_tensor

NB, H, N, D = 5, 3, 4, 6


def arange_5d(shape, order_name):
    numel = 1
    for size in shape:
        numel *= size
    return strided_5d(shape, STRIDE_ORDERS[order_name], torch.arange(numel))


def describe(tensor, backend="FLASH_ATTN", *, num_blocks=NB, heads=H, head_size=D, mla=False):
    return describe_kv_tensor(
        tensor,
        num_blocks=num_blocks,
        block_size=N,
        num_kv_heads=heads,
        head_size=head_size,
        is_mla=mla,
        backend_name=backend,
    )


def assert_segments_match_cells(layout, tensor):
    """Segments cover each block once, and block_order reads them back as cells."""
    segments = layout.block_segments(tensor)
    assert all(s.stride(1) == 1 and s.shape == (NB, layout.segment_elems) for s in segments)
    rows = torch.cat(segments, dim=1)
    assert rows.shape[1] == layout.elems_per_block == layout.planes * N * H * D
    cells = layout.cells(tensor)
    assert torch.equal(layout.block_order.view(rows), cells)
    flat = rows.flatten()
    assert flat.unique().numel() == flat.numel()


def test_cpu_attn_k_then_v_per_block_and_head():
    tensor = torch.arange(NB * H * N * 2 * D).view(NB, H, N, 2 * D)
    layout = describe(tensor, "CPU_ATTN")
    sv = layout.semantic_view(tensor)
    assert sv.shape == (NB, 2, N, H, D)
    as_backend = tensor.view(NB, H, 2 * N, D)
    for b, h, n in [(0, 0, 0), (4, 2, 3), (2, 1, 1)]:
        assert torch.equal(sv[b, 0, n, h], as_backend[b, h, n])
        assert torch.equal(sv[b, 1, n, h], as_backend[b, h, N + n])
    assert layout.kind == "cpu_split" and layout.num_segments == 1
    assert_segments_match_cells(layout, tensor)


@pytest.mark.parametrize("order", sorted(STRIDE_ORDERS))
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"])
def test_packed_k_v_in_content(order, backend):
    layers = arange_5d((2, NB, H, N, 2 * D), order)
    tensor = layers[1]
    layout = describe(tensor, backend)
    sv = layout.semantic_view(tensor)
    # The backends read K/V as kv.transpose(1, 2).split(head_size, dim=-1).
    key, value = tensor.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(sv[:, 0], key) and torch.equal(sv[:, 1], value)
    assert_segments_match_cells(layout, tensor)
    # One run per block when [H, N, C] are the innermost axes; else one per head.
    block_contiguous = set(STRIDE_ORDERS[order][-3:]) == {2, 3, 4}
    assert layout.num_segments == (1 if block_contiguous else H)


@pytest.mark.parametrize("three_d", [False, True])
def test_mla_single_plane(three_d):
    latent = 10
    tensor = torch.arange(NB * N * latent).view(NB, 1, N, latent)
    tensor = tensor[:, 0] if three_d else tensor
    layout = describe(tensor, "FLASHMLA", heads=1, head_size=latent, mla=True)
    sv = layout.semantic_view(tensor)
    assert sv.shape == (NB, 1, N, 1, latent)
    flat = tensor.reshape(NB, N, latent)
    assert torch.equal(sv[:, 0, :, 0], flat)
    assert layout.planes == 1 and layout.num_segments == 1
    assert layout.block_segments(tensor)[0].shape == (NB, N * latent)


@pytest.mark.parametrize("physical", ["NHD", "HND"])
@pytest.mark.parametrize("plane_axis", [0, 1])
def test_legacy_5d_plane_axis(plane_axis, physical):
    # Logical [2, B, N, H, D] (FlashAttention) or [B, 2, N, H, D] (FlashInfer);
    # HND stores heads before tokens.
    logical = [2, NB, N, H, D] if plane_axis == 0 else [NB, 2, N, H, D]
    order = (0, 1, 2, 3, 4) if physical == "NHD" else (0, 1, 3, 2, 4)
    tensor = strided_5d(tuple(logical), order, torch.arange(2 * NB * N * H * D))
    layout = describe(tensor)
    sv = layout.semantic_view(tensor)
    expected = tensor.transpose(0, 1) if plane_axis == 0 else tensor
    assert torch.equal(sv, expected)
    assert layout.num_segments == (2 if plane_axis == 0 else 1)
    assert_segments_match_cells(layout, tensor)


@pytest.mark.parametrize("order,mergeable", [("LBNHC", True), ("LBHNC", False)])
def test_kernel_block_split(order, mergeable):
    kernel_blocks, kernel_tokens = 2, N // 2
    tensor = arange_5d((1, NB * kernel_blocks, H, kernel_tokens, 2 * D), order)[0]
    layout = describe(tensor)
    assert layout.kernel_blocks == kernel_blocks and layout.block_size == N
    cells = layout.cells(tensor)
    key = tensor.transpose(1, 2)[..., :D].reshape(NB, kernel_blocks, kernel_tokens, H, D)
    assert torch.equal(cells[:, 0], key)
    assert_segments_match_cells(layout, tensor)
    if mergeable:
        assert torch.equal(layout.semantic_view(tensor)[:, 0], key.reshape(NB, N, H, D))
    else:
        with pytest.raises(ValueError, match="kernel blocks"):
            layout.semantic_view(tensor)


@pytest.mark.parametrize(
    "shape,backend,match",
    [
        ((NB, H, N, 2 * D), "SOME_NEW_ATTN", "unknown backend"),
        ((NB, H, N, 2 * D + 2), "FLASH_ATTN", "head_size"),
        ((NB, H + 1, N, 2 * D), "CPU_ATTN", "CPU_ATTN expects"),
        ((NB * 3, H, N // 2, 2 * D), "FLASH_ATTN", "kernel blocks"),
        ((NB, 2, N, H, D, 1), "FLASH_ATTN", "4-D"),
    ],
)
def test_unknown_layouts_are_refused(shape, backend, match):
    tensor = torch.zeros(shape)
    with pytest.raises(ValueError, match=match) as info:
        describe(tensor, backend)
    assert backend in str(info.value) and str(tuple(shape)) in str(info.value)


def test_cpu_attn_refuses_non_contiguous_slab():
    tensor = arange_5d((1, NB, H, N, 2 * D), "LBNHC")[0]
    with pytest.raises(ValueError, match="slab"):
        describe(tensor, "CPU_ATTN")


def test_check_rejects_a_different_tensor():
    tensor = torch.zeros(NB, H, N, 2 * D)
    layout = describe(tensor)
    with pytest.raises(ValueError, match="does not match"):
        layout.cells(tensor.to(torch.float16))
