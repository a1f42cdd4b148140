"""Host (L2) pool layouts: where each element of a page lives in the buffer.

A page is one vLLM block of every attention layer. Per layer, a block holds
``planes x block_size x heads x head_size`` elements (planes: 2 for K and V,
1 for MLA's latent). The three layouts (config values of
``hicache_mem_layout``, named as in SGLang):

    layer_first        buffer [num_layers, num_pages, E]
    page_first_direct  buffer [num_pages, num_layers, E]
    page_first         buffer [num_pages, planes, block_size, num_layers, heads, head_size]

where E = elements of one block of one layer. In the first two, a (layer,
page) row stores the block in the L1 tensor's *native* order: the block's
bytes as they sit in vLLM's KV tensor, gaps removed. ``BlockOrder`` records
that order as strides, so the pool can still present any page in the
canonical order ``[planes, block_size, heads, head_size]``. ``page_first`` is
token-major and independent of the L1 layout (K blob then V blob, each
token-major across layers, as in SGLang); filling it needs a transposing copy.

Inside ``BlockOrder`` the token axis is split in two, ``kernel_blocks x
kernel_block_size``: vLLM may split one manager block into several kernel
blocks (a backend that supports only smaller blocks), and the two token
sub-axes then have strides that cannot always be merged into one.

Head slices (heterogeneous TP, keys.HeadSlicing): an L3 object may hold a
run of a page's heads instead of all of them. Its payload keeps the layout's
payload order (``payload_axes``) with fewer heads, so a rank whose page is
exactly one slice stores its page as it is (zero copy in the page-major
layouts), and a rank with several slices per page copies each out
(``head_slice``).

Invariant: every view returned here is a strided view of the buffer (never a
copy), and each element of the buffer belongs to exactly one
(page, layer, plane, token, head, element) cell.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vllm_hicache.host.layout_names import MEM_LAYOUTS, NATIVE_LAYOUTS, MemLayout

# Sizes or strides of the five block axes (see ``BlockDims``).
Dims5 = tuple[int, int, int, int, int]


def as_dims5(values: Iterable[int]) -> Dims5:
    """``values`` as a ``Dims5``; ValueError unless there are exactly five."""
    items = tuple(values)
    if len(items) != 5:
        raise ValueError(f"expected 5 block axes, got {len(items)}: {items}")
    return items[0], items[1], items[2], items[3], items[4]


class BlockDims:
    """Named sizes of ``dims`` = [planes, kernel_blocks, kernel_block_size,
    heads, head_size], shared by host and device block descriptors."""

    dims: Dims5

    @property
    def planes(self) -> int:
        return self.dims[0]

    @property
    def kernel_blocks(self) -> int:
        return self.dims[1]

    @property
    def block_size(self) -> int:
        return self.dims[1] * self.dims[2]

    @property
    def heads(self) -> int:
        return self.dims[3]

    @property
    def head_size(self) -> int:
        return self.dims[4]


@dataclass(frozen=True)
class BlockOrder(BlockDims):
    """Order of one block's elements inside a host row of E elements.

    ``dims`` are the sizes of [planes, kernel_blocks, kernel_block_size,
    heads, head_size] and ``strides`` their strides within the row (in
    elements). ``canonical`` is the C-contiguous order of those dims.
    """

    dims: Dims5
    strides: Dims5

    def __post_init__(self) -> None:
        assert len(self.dims) == 5 and len(self.strides) == 5, self
        # A size-1 axis's stride is arbitrary; zero it so that equal orders
        # compare equal whatever their source wrote there.
        strides = tuple(s if n > 1 else 0 for s, n in zip(self.strides, self.dims))
        object.__setattr__(self, "strides", strides)
        covered = sorted((s, n) for s, n in zip(self.strides, self.dims) if n > 1)
        extent = 1
        for stride, size in covered:
            # A row of E elements is covered exactly once: sorted by stride,
            # each axis must step over everything nested inside it.
            assert stride == extent, f"block order {self} has gaps or overlaps"
            extent *= size

    @classmethod
    def canonical(
        cls,
        planes: int,
        block_size: int,
        heads: int,
        head_size: int,
        kernel_blocks: int = 1,
    ) -> BlockOrder:
        assert block_size % kernel_blocks == 0, (block_size, kernel_blocks)
        dims = (planes, kernel_blocks, block_size // kernel_blocks, heads, head_size)
        return cls(dims, _contiguous_strides(dims))

    @property
    def elems(self) -> int:
        return math.prod(self.dims)

    def nesting(self) -> tuple[int, ...]:
        """Indices of ``dims``, outermost first (size-1 axes last: their
        place does not move any element)."""
        return tuple(sorted(range(5), key=lambda i: -self.strides[i]))

    def with_heads(self, heads: int) -> BlockOrder:
        """The same nesting of axes for a block of ``heads`` of these heads,
        gaps closed: the order of one head slice's run (``head_slice_layout``)."""
        assert 0 < heads <= self.heads and self.heads % heads == 0, (heads, self)
        dims = (*self.dims[:3], heads, self.dims[4])
        strides, step = [0] * 5, 1
        for axis in reversed(self.nesting()):
            strides[axis] = step
            step *= dims[axis]
        return BlockOrder(dims, as_dims5(strides))

    def view(self, rows: torch.Tensor) -> torch.Tensor:
        """View rows ``[..., E]`` (last dim contiguous) as ``[..., *dims]``."""
        assert rows.shape[-1] == self.elems and rows.stride(-1) == 1, (
            tuple(rows.shape),
            rows.stride(),
        )
        return rows.as_strided(
            (*rows.shape[:-1], *self.dims),
            (*rows.stride()[:-1], *self.strides),
        )


def _contiguous_strides(dims: Dims5) -> Dims5:
    strides, step = [], 1
    for size in reversed(dims):
        strides.append(step)
        step *= size
    return as_dims5(reversed(strides))


@dataclass(frozen=True)
class HostLayout:
    """Shape of the host buffer and the views the copy paths use."""

    name: str
    num_pages: int
    num_layers: int
    order: BlockOrder

    def __post_init__(self) -> None:
        if self.name not in MEM_LAYOUTS:
            raise ValueError(
                f"unknown host memory layout {self.name!r}; accepted: "
                f"{', '.join(MEM_LAYOUTS)} (hicache_mem_layout)"
            )
        assert self.num_pages > 0 and self.num_layers > 0, self

    @property
    def elems_per_block(self) -> int:
        """Elements of one block of one layer (E)."""
        return self.order.elems

    @property
    def elems_per_page(self) -> int:
        return self.order.elems * self.num_layers

    @property
    def is_native(self) -> bool:
        return self.name in NATIVE_LAYOUTS

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        o, pages, layers = self.order, self.num_pages, self.num_layers
        if self.name == MemLayout.LAYER_FIRST:
            return (layers, pages, o.elems)
        if self.name == MemLayout.PAGE_FIRST_DIRECT:
            return (pages, layers, o.elems)
        return (pages, o.planes, o.block_size, layers, o.heads, o.head_size)

    def rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[num_pages, num_layers, E]`` rows of a native layout (a view)."""
        assert self.is_native, self.name
        return buffer.transpose(0, 1) if self.name == MemLayout.LAYER_FIRST else buffer

    def cells(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[num_pages, num_layers, planes, kernel_blocks, kernel_block_size,
        heads, head_size]``: every element addressed semantically (a view)."""
        assert tuple(buffer.shape) == self.buffer_shape, (buffer.shape, self)
        if self.is_native:
            return self.order.view(self.rows(buffer))
        pages, planes, tokens, layers, heads, dim = buffer.stride()
        kernel_block_size = self.order.dims[2]
        return buffer.as_strided(
            (self.num_pages, self.num_layers, *self.order.dims),
            (pages, layers, planes, kernel_block_size * tokens, tokens, heads, dim),
        )


    def payload_axes(self) -> tuple[int, ...]:
        """The axes of one page's ``cells`` ([layer, plane, kernel_block,
        token_in_kernel_block, head, elem]), outermost first, in the byte
        order of the page's L3 payload (l3_identity.page_format_of):
        layer_first the canonical order, page_first the page itself,
        page_first_direct the layers, each in the native block order."""
        if self.name == MemLayout.LAYER_FIRST:
            return (0, 1, 2, 3, 4, 5)
        if self.name == MemLayout.PAGE_FIRST:
            return (1, 2, 3, 0, 4, 5)
        return (0, *(1 + axis for axis in self.order.nesting()))

    def layer_payload_axes(self) -> tuple[int, ...] | None:
        """The axes of one layer's block (``cells`` of one page and layer:
        [plane, kernel_block, token_in_kernel_block, head, elem]) in the
        byte order of that layer's run of the L3 payload; None where the
        payload is not layer-major (page_first: token-major across layers),
        so a layer's bytes are not one run of it."""
        axes = self.payload_axes()
        if axes[0] != 0:
            return None
        return tuple(axis - 1 for axis in axes[1:])

    def head_slice_layout(self, heads: int) -> HostLayout:
        """A one-page layout whose page is one run of ``heads`` of this
        layout's heads, in this layout's payload order (what an L3 head
        slice object holds; its page format names those bytes)."""
        return HostLayout(self.name, 1, self.num_layers, self.order.with_heads(heads))

    def head_slice(self, buffer: torch.Tensor, page: int, first_head: int,
                   num_heads: int) -> torch.Tensor:
        """Heads [first_head, first_head + num_heads) of ``page``, axes in
        payload order (a strided view). A copy of it is the slice's payload,
        byte for byte the page of ``head_slice_layout(num_heads)``; with all
        of a page-major layout's heads it is the page run itself."""
        cells = self.cells(buffer)[page]
        return cells[..., first_head:first_head + num_heads, :].permute(self.payload_axes())


def page_bytes(num_layers: int, elems_per_block: int, dtype: torch.dtype) -> int:
    """Bytes of one host page: one block of every layer."""
    return num_layers * elems_per_block * dtype_size(dtype)


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pool_bytes(layout: HostLayout, dtype: torch.dtype) -> int:
    return layout.num_pages * page_bytes(layout.num_layers, layout.elems_per_block, dtype)
