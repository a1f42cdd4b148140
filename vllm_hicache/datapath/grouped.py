"""Copies for hybrid models: one id space over several KV cache groups.

With vLLM's hybrid allocator a model's layers fall into KV cache groups
(e.g. sliding-window and full-attention layers), each with its own block
table: block ids are unique only within a group, and layers of different
groups alias the same L1 memory. A host page still holds one block position
of *every* layer, so a copy of one position names one L1 block per group.

``GroupedTransfer`` lets ``KVDataPath`` stay group-blind: a copy names
group g's block b by the *group block id* ``g * num_l1_blocks + b``, and a
page appears once per group whose block it fills. Each (group block id,
page) pair copies only that group's layers, so a group without a block at
some position (a sliding window's skipped block) leaves that part of the
page untouched on a store and that L1 block unwritten on a load.

Invariant: a pair never touches layers outside its group; the layers of a
group are a contiguous range of the pool's layers.

Mamba / linear-attention state layers reach vLLM's connector as raw int8
tensors ``[blocks, 1, 1, state bytes]`` whose block stride is the padded
page, exactly one attention page (vLLM pads the state page to match).
``block_view`` reinterprets such a tensor with the shape, strides and dtype
of an attention layer's tensor over the same bytes, so the copy engines and
the pool layout treat it as one more layer, and a copy moves each state page
byte for byte, padding included (the padding belongs to no other block, and
copying it keeps one layout for every layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_view(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``raw``'s memory (one page per block) seen as a tensor shaped like
    ``like`` (an attention layer's L1 tensor with the same number of blocks
    and page bytes); ValueError if the bytes cannot be reinterpreted exactly.
    """
    page_bytes = raw.stride(0) * raw.element_size()
    like_page = like.stride(0) * like.element_size()
    elem = like.element_size()
    if raw.shape[0] != like.shape[0] or page_bytes != like_page:
        raise ValueError(
            f"state tensor {tuple(raw.shape)} (page {page_bytes} B) does not match the "
            f"attention tensor {tuple(like.shape)} (page {like_page} B) block for block")
    if like[0].numel() * elem != like_page or not like[0].is_contiguous():
        raise ValueError(f"attention tensor {tuple(like.shape)} stride {like.stride()} does "
                         "not keep each block in one contiguous page")
    offset_bytes = raw.storage_offset() * raw.element_size()
    storage = raw.untyped_storage()
    if offset_bytes % elem or offset_bytes + raw.shape[0] * page_bytes > storage.nbytes():
        raise ValueError(f"state tensor at byte offset {offset_bytes} cannot be viewed as "
                         f"{like.dtype} pages")
    view = torch.empty(0, dtype=like.dtype, device=raw.device)
    view.set_(storage, offset_bytes // elem, like.shape, like.stride())
    return view


def copy_bytes(transfer, block_ids: Sequence[int], page_bytes: int) -> int:
    """Bytes a store or load of ``block_ids`` moves through ``transfer``:
    a page per block, or through a ``GroupedTransfer`` each pair's group's
    share of a page (metrics: a page appears once per group it fills)."""
    if isinstance(transfer, GroupedTransfer):
        return transfer.copy_bytes(block_ids, page_bytes)
    return len(block_ids) * page_bytes


class GroupedTransfer:
    """A ``KVTransfer``-like engine over per-group blocks of one inner
    transfer (built over every layer, group by group, and one pool)."""

    def __init__(self, inner, group_layers: Sequence[range], num_l1_blocks: int) -> None:
        self.inner = inner
        self.io_backend = inner.io_backend
        self._groups = list(group_layers)
        self._num_l1_blocks = num_l1_blocks
        self._group_of_layer = {
            layer: g for g, layers in enumerate(self._groups) for layer in layers
        }

    def split(self, block_ids: Sequence[int],
              page_ids: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
        """``(group, block ids, page ids)`` per group named by the pairs."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for gid, page in zip(block_ids, page_ids):
            group, block = divmod(gid, self._num_l1_blocks)
            if group >= len(self._groups):
                raise ValueError(f"group block id {gid} names group {group}; the model has "
                                 f"{len(self._groups)}")
            blocks, pages = by_group.setdefault(group, ([], []))
            blocks.append(block)
            pages.append(page)
        return [(g, b, p) for g, (b, p) in sorted(by_group.items())]

    def copy_bytes(self, block_ids: Sequence[int], page_bytes: int) -> int:
        """Bytes the pairs of ``block_ids`` move: each its group's layers of a page."""
        num_layers = sum(len(layers) for layers in self._groups)
        per_pair = [page_bytes * len(layers) // num_layers for layers in self._groups]
        return sum(per_pair[gid // self._num_l1_blocks] for gid in block_ids)

    def store(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        for group, blocks, pages in self.split(block_ids, page_ids):
            self.inner.copy_layers(self._groups[group], blocks, pages, to_host=True)

    def load(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        for group, blocks, pages in self.split(block_ids, page_ids):
            self.inner.copy_layers(self._groups[group], blocks, pages, to_host=False)

    def load_layer(self, layer_index: int, block_ids: Sequence[int],
                   page_ids: Sequence[int]) -> None:
        group = self._group_of_layer[layer_index]
        blocks: list[int] = []
        pages: list[int] = []
        for g, b, p in self.split(block_ids, page_ids):
            if g == group:
                blocks, pages = b, p
        # Called even with nothing to copy: the inner transfer marks the layer.
        self.inner.load_layer(layer_index, blocks, pages)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def wait_layer(self, layer_index: int) -> None:
        self.inner.wait_layer(layer_index)
