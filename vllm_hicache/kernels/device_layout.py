"""Where each KV element of one attention layer lives in vLLM's L1 tensor.

vLLM hands ``register_kv_caches`` one tensor per attention layer. In vLLM
0.32 every backend's tensor is a strided view ``[B, H, N, C]`` (blocks,
heads, tokens, content) of one shared int8 allocation; its physical order is
one of ``KVCacheLayout`` (LBHNC, LBNHC, BLHNC, ...), i.e. only the strides
differ. What the content C means depends on the backend:

    FLASH_ATTN / FLASHINFER /    C = [K head_size | V head_size] per (block,
    TRITON_ATTN / FLEX_ATTENTION head, token): ``kv.transpose(1,2).split(D)``
    CPU_ATTN                     [B, H, N, 2D] contiguous per (block, head),
                                 read as ``kv.view(B, H, 2N, D)``: K of all N
                                 tokens, then V of all N tokens
    MLA (any backend, is_mla)    [B, 1, N, latent] or [B, N, latent]: 1 plane

Older vLLM (and some out-of-tree backends) use 5-D tensors with a K/V plane
axis, logical shape ``[2, B, N, H, D]`` (FlashAttention) or ``[B, 2, N, H, D]``
(FlashInfer), physical order again in the strides; both are accepted.
Anything else raises ValueError naming the backend and the shape: a wrong
guess here would silently scramble the KV cache.

vLLM may split each manager block into ``kernel_blocks`` kernel blocks
(B = num_blocks x kernel_blocks); the descriptor addresses a manager block
as ``[planes, kernel_blocks, kernel_block_size, heads, head_size]`` cells.

Segments: a block's elements, in memory order, form one or more equal
contiguous runs (1 for the block-contiguous layouts, 2 for a plane-outer
tensor, H for a head-outer one). A host row concatenates them: that is the
block's *native order* (``block_order``), what the native host layouts store.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm_hicache.host.layout import BlockDims, BlockOrder

PACKED_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
CPU_BACKENDS = ("CPU_ATTN",)


@dataclass(frozen=True)
class DeviceKVLayout(BlockDims):
    """Frozen description of one layer's L1 KV tensor (all layers share one)."""

    backend_name: str
    # packed | cpu_split | mla | plane_outer | block_outer
    kind: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    num_blocks: int
    # Sizes of [planes, kernel_blocks, kernel_block_size, heads, head_size].
    dims: tuple[int, int, int, int, int]
    # Tensor-element strides of [block, *dims].
    cell_strides: tuple[int, int, int, int, int, int]
    # Element offsets of the segments from the block start, in memory order.
    segment_offsets: tuple[int, ...]
    segment_elems: int
    block_order: BlockOrder

    @property
    def block_stride(self) -> int:
        return self.cell_strides[0]

    @property
    def num_segments(self) -> int:
        return len(self.segment_offsets)

    @property
    def elems_per_block(self) -> int:
        return self.segment_elems * self.num_segments

    def check(self, tensor: torch.Tensor) -> None:
        got = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if got != (self.shape, self.stride, self.dtype):
            raise ValueError(
                f"KV tensor {got} does not match its layout descriptor "
                f"({self.shape}, {self.stride}, {self.dtype})"
            )

    def cells(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, planes, kernel_blocks, kernel_block_size, heads,
        head_size]`` strided view of ``tensor`` (no copy)."""
        self.check(tensor)
        return tensor.as_strided((self.num_blocks, *self.dims), self.cell_strides)

    def semantic_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, planes, block_size, heads, head_size]`` strided view.

        Raises ValueError when split kernel blocks cannot be addressed as one
        token axis by strides alone (use ``cells`` then).
        """
        cells = self.cells(tensor)
        kernel_blocks, kernel_block_size = self.dims[1:3]
        kb_stride, token_stride = self.cell_strides[2:4]
        if kernel_blocks > 1 and kb_stride != kernel_block_size * token_stride:
            raise ValueError(
                f"{self.backend_name} tensor {self.shape} stride {self.stride}: "
                f"its {kernel_blocks} kernel blocks per block are not one strided "
                "token axis; use cells()"
            )
        strides = list(cells.stride())
        del strides[2]
        return cells.as_strided(
            (self.num_blocks, self.planes, self.block_size, self.heads, self.head_size),
            strides,
        )

    def block_segments(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``[num_blocks, segment_elems]`` views with contiguous rows, covering
        each block's elements exactly once, in native order."""
        self.check(tensor)
        base = tensor.storage_offset()
        return [
            tensor.as_strided(
                (self.num_blocks, self.segment_elems),
                (self.block_stride, 1),
                base + offset,
            )
            for offset in self.segment_offsets
        ]


def describe_kv_tensor(
    tensor: torch.Tensor,
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    is_mla: bool,
    backend_name: str,
) -> DeviceKVLayout:
    """Describe one layer's L1 tensor; ValueError if the layout is unknown."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    refuse = _refuser(tensor, backend_name, num_blocks=num_blocks, block_size=block_size,
                      num_kv_heads=num_kv_heads, head_size=head_size, is_mla=is_mla)
    axes = _interpret(shape, stride, backend_name, num_kv_heads, head_size, is_mla, refuse)
    kernel_blocks = _kernel_blocks(axes, num_blocks, block_size, refuse)
    kb_stride, plane_stride, token_stride, head_stride, elem_stride = axes.strides
    dims = (axes.planes, kernel_blocks, axes.kernel_block_size, axes.heads, head_size)
    in_block = (plane_stride, kb_stride, token_stride, head_stride, elem_stride)
    offsets, seg_elems, native = _segments(dims, in_block, refuse)
    block_stride = kb_stride * kernel_blocks
    _check_disjoint(((block_stride, num_blocks), *zip(in_block, dims)), refuse)
    return DeviceKVLayout(
        backend_name=backend_name,
        kind=axes.kind,
        shape=shape,
        stride=stride,
        dtype=tensor.dtype,
        num_blocks=num_blocks,
        dims=dims,
        cell_strides=(block_stride, *in_block),
        segment_offsets=offsets,
        segment_elems=seg_elems,
        block_order=BlockOrder(dims, native),
    )


def _refuser(tensor: torch.Tensor, backend_name: str, **geometry):
    """A ValueError factory naming the backend, the tensor and the geometry."""
    described = ", ".join(f"{k}={v}" for k, v in geometry.items())

    def refuse(why: str) -> ValueError:
        return ValueError(
            f"unsupported KV cache layout for attention backend {backend_name!r}: "
            f"tensor shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}, "
            f"dtype {tensor.dtype} ({described}): {why}"
        )

    return refuse


class _Axes(NamedTuple):
    """A backend's reading of its tensor, before grouping kernel blocks."""

    kind: str
    num_kernel_blocks: int
    planes: int
    kernel_block_size: int
    heads: int
    # Strides of [kernel block, plane, token, head, elem].
    strides: tuple[int, int, int, int, int]


def _kernel_blocks(axes: _Axes, num_blocks: int, block_size: int, refuse) -> int:
    """Kernel blocks per manager block (vLLM's kernel block splitting)."""
    ratio, rest = divmod(axes.num_kernel_blocks, num_blocks)
    if rest or ratio * axes.kernel_block_size != block_size:
        raise refuse(
            f"{axes.num_kernel_blocks} kernel blocks of {axes.kernel_block_size} tokens "
            f"do not make {num_blocks} blocks of {block_size} tokens"
        )
    return ratio


def _interpret(shape, stride, backend, heads, head_size, is_mla, refuse) -> _Axes:
    if is_mla:
        if len(shape) == 3:
            shape, stride = (shape[0], 1, *shape[1:]), (stride[0], 0, *stride[1:])
        if len(shape) != 4 or shape[1] != 1 or shape[3] != head_size:
            raise refuse("MLA expects [blocks, 1, block_size, latent] or [blocks, block_size, "
                         "latent]")
        s_block, _, s_token, s_elem = stride
        return _Axes("mla", shape[0], 1, shape[2], 1, (s_block, 0, s_token, 0, s_elem))
    if backend in CPU_BACKENDS:
        if len(shape) != 4 or shape[1] != heads or shape[3] != 2 * head_size:
            raise refuse("CPU_ATTN expects [blocks, heads, block_size, 2 * head_size]")
        if stride[3] != 1 or (shape[2] > 1 and stride[2] != shape[3]):
            raise refuse("CPU_ATTN needs each (block, head) slab contiguous")
        strides = (stride[0], shape[2] * head_size, head_size, stride[1], 1)
        return _Axes("cpu_split", shape[0], 2, shape[2], heads, strides)
    if backend not in PACKED_BACKENDS:
        known = ", ".join(PACKED_BACKENDS + CPU_BACKENDS)
        raise refuse(f"unknown backend; supported: {known} and MLA (is_mla=True)")
    if len(shape) == 4:
        if shape[1] != heads or shape[3] != 2 * head_size:
            raise refuse("expected [blocks, heads, block_size, head_size + head_size]")
        strides = (stride[0], head_size * stride[3], stride[2], stride[1], stride[3])
        return _Axes("packed", shape[0], 2, shape[2], heads, strides)
    if len(shape) == 5 and (shape[0] == 2) != (shape[1] == 2):
        plane_axis = 0 if shape[0] == 2 else 1
        block_axis = 1 - plane_axis
        if shape[3:] != (heads, head_size):
            raise refuse("expected [.., block_size, heads, head_size] after the plane axis")
        strides = (stride[block_axis], stride[plane_axis], stride[2], stride[3], stride[4])
        kind = "plane_outer" if plane_axis == 0 else "block_outer"
        return _Axes(kind, shape[block_axis], 2, shape[2], heads, strides)
    raise refuse("expected a 4-D [blocks, heads, block_size, 2 * head_size] tensor")


def _segments(dims, strides, refuse):
    """Split a block into contiguous segments.

    Returns (segment offsets, segment length, native strides of ``dims``).
    Axes of size 1 are ignored (their strides are arbitrary).
    """
    axes = sorted(
        ((stride, size, i) for i, (size, stride) in enumerate(zip(dims, strides)) if size > 1),
        reverse=True,
    )
    # axes: outermost first. Fold unit-stride-nested axes into one run.
    seg_elems, k = 1, len(axes)
    while k > 0 and axes[k - 1][0] == seg_elems:
        seg_elems *= axes[k - 1][1]
        k -= 1
    if k and seg_elems == 1:
        raise refuse("the innermost KV axis is not contiguous")
    outer = axes[:k]
    native = list(strides)
    step = seg_elems
    for _stride, size, i in reversed(outer):
        native[i] = step
        step *= size
    offsets = tuple(
        sum(index * stride for index, (stride, _, _) in zip(indices, outer))
        for indices in itertools.product(*(range(size) for _, size, _ in outer))
    )
    assert len(offsets) * seg_elems == math.prod(dims), (offsets, seg_elems, dims)
    return offsets, seg_elems, tuple(native)


def _check_disjoint(axes, refuse) -> None:
    """Refuse (stride, size) axes that could address one element twice.

    Sufficient test: sorted by stride, each axis steps over the whole span
    of the axes nested inside it (true of every layout vLLM allocates,
    including block-interleaved ones such as LHBNC).
    """
    span = 1
    for stride, size in sorted((s, n) for s, n in axes if n > 1):
        if stride < span:
            raise refuse("two KV cells share memory (overlapping strides)")
        span = stride * (size - 1) + span
