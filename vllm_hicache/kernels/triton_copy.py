"""Triton kernels for L1 <-> L2 copies (``hicache_io_backend=kernel``).

Two kernels, both addressed by raw byte addresses loaded from int64
tables rather than by tensor arguments, because one launch touches many
layer tensors and the host pool at once:

* ``copy_items``: item i copies ``item_bytes`` contiguous bytes from
  ``src_addrs[i]`` to ``dst_addrs[i]`` (native layouts: one item per
  (layer, segment, block)).
* ``copy_page_first``: the transposing copy between a block's cells in an
  L1 tensor and a ``page_first`` host page, one program per (pair, layer,
  row tile); a row is one (plane, token, head) of ``head_size`` elements.

Assumption (UVA): on CUDA the host pool is pinned and registered as
mapped, so its host address is also a valid device address (true for
64-bit Linux with unified addressing; ``HostKVPool`` pins with
``cudaHostRegisterMapped``). The kernels never see the host tensor, only
its address. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU
tensors, which is how the tests check them against the torch reference.

This module imports triton at import time; import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Copy units per program: 4096 x 8 B = 32 KiB per program for copy_items
# and per row tile of copy_page_first. NOT tuned yet: written without GPU
# access; a starting point that gives a 128 KiB block item 4 programs and
# keeps tiles small enough for the interpreter tests. Tune on H100/H200.
ITEM_TILE_UNITS = 4096
PAGE_FIRST_TILE_UNITS = 4096

UNIT_TYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _copy_items_kernel(
    src_addrs, dst_addrs, item_units, UNIT: tl.constexpr, TILE: tl.constexpr
):
    item = tl.program_id(0)
    src = tl.load(src_addrs + item).to(tl.pointer_type(UNIT))
    dst = tl.load(dst_addrs + item).to(tl.pointer_type(UNIT))
    offsets = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offsets < item_units
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


@triton.jit
def _page_first_kernel(
    bases, block_ids, page_ids, layer_start,  # bases: [host pool, layer 0, layer 1, ...]
    num_rows, heads, block_size, kernel_block_size, row_units,  # a row: head_size elems
    d_block, d_plane, d_kblock, d_token, d_head,  # L1 strides in units
    h_page, h_layer, h_plane, h_token, h_head,  # host strides in units
    TO_HOST: tl.constexpr, UNIT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = layer_start + tl.program_id(1)
    block = tl.load(block_ids + pair).to(tl.int64)
    page = tl.load(page_ids + pair).to(tl.int64)
    host = tl.load(bases).to(tl.pointer_type(UNIT))
    dev = tl.load(bases + 1 + layer).to(tl.pointer_type(UNIT))
    rows = (tl.program_id(2) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    head = rows % heads
    token = (rows // heads) % block_size
    plane = rows // (heads * block_size)
    dev_rows = (
        block * d_block + plane * d_plane + (token // kernel_block_size) * d_kblock
        + (token % kernel_block_size) * d_token + head * d_head
    )
    host_rows = page * h_page + layer * h_layer + plane * h_plane + token * h_token + head * h_head
    cols = tl.arange(0, COLS)
    mask = (rows < num_rows)[:, None] & (cols < row_units)[None, :]
    if TO_HOST:
        src = dev + dev_rows[:, None] + cols[None, :]
        dst = host + host_rows[:, None] + cols[None, :]
    else:
        src = host + host_rows[:, None] + cols[None, :]
        dst = dev + dev_rows[:, None] + cols[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def is_interpreted() -> bool:
    """True when these kernels were built for the CPU interpreter
    (``TRITON_INTERPRET=1`` was set before this module was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_copy_items_kernel, InterpretedFunction)


def _check_table(name: str, table: torch.Tensor) -> None:
    assert table.dtype == torch.int64 and table.dim() == 1 and table.is_contiguous(), (
        name,
        table.dtype,
        tuple(table.shape),
    )


def copy_items(
    src_addrs: torch.Tensor, dst_addrs: torch.Tensor, item_bytes: int, unit_bytes: int
) -> None:
    """Copy ``item_bytes`` from each ``src_addrs[i]`` to ``dst_addrs[i]``.

    ``unit_bytes`` (1, 2, 4 or 8) must divide ``item_bytes`` and every address.
    """
    _check_table("src_addrs", src_addrs)
    _check_table("dst_addrs", dst_addrs)
    assert src_addrs.shape == dst_addrs.shape and src_addrs.device == dst_addrs.device
    assert unit_bytes in UNIT_TYPES and item_bytes % unit_bytes == 0, (item_bytes, unit_bytes)
    num_items = src_addrs.numel()
    if num_items == 0:
        return
    item_units = item_bytes // unit_bytes
    tile = min(ITEM_TILE_UNITS, triton.next_power_of_2(item_units))
    grid = (num_items, triton.cdiv(item_units, tile))
    unit = UNIT_TYPES[unit_bytes]
    _copy_items_kernel[grid](src_addrs, dst_addrs, item_units, UNIT=unit, TILE=tile)


def copy_page_first(
    bases: torch.Tensor,
    block_ids: torch.Tensor,
    page_ids: torch.Tensor,
    layers: range,
    shape: tuple[int, int, int, int, int],
    device_strides: tuple[int, int, int, int, int],
    host_strides: tuple[int, int, int, int, int],
    unit_bytes: int,
    to_host: bool,
) -> None:
    """Transposing copy between L1 block cells and ``page_first`` host pages.

    ``shape`` = (planes, block_size, kernel_block_size, heads, row_units);
    ``device_strides`` = L1 (block, plane, kernel block, token, head) and
    ``host_strides`` = host (page, layer, plane, token, head), all in units
    of ``unit_bytes``; rows of ``row_units`` are contiguous on both sides.
    """
    _check_table("bases", bases)
    _check_table("block_ids", block_ids)
    _check_table("page_ids", page_ids)
    assert block_ids.shape == page_ids.shape and unit_bytes in UNIT_TYPES
    assert layers.step == 1 and 0 <= layers.start and layers.stop < bases.numel(), layers
    planes, block_size, kernel_block_size, heads, row_units = shape
    if block_ids.numel() == 0 or len(layers) == 0:
        return
    cols = triton.next_power_of_2(row_units)
    rows_per_tile = max(1, PAGE_FIRST_TILE_UNITS // cols)
    num_rows = planes * block_size * heads
    grid = (block_ids.numel(), len(layers), triton.cdiv(num_rows, rows_per_tile))
    _page_first_kernel[grid](
        bases, block_ids, page_ids, layers.start, num_rows, heads, block_size,
        kernel_block_size, row_units, *device_strides, *host_strides,
        TO_HOST=to_host, UNIT=UNIT_TYPES[unit_bytes], ROWS=rows_per_tile, COLS=cols,
    )
