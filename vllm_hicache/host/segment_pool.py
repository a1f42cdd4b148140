"""A host KV pool whose pages are the node tier's slots, read in place.

The node tier's segment (node/segment.py) holds one L3 object per slot: a
64-byte object header, then the payload, which for the page-major layouts
(``page_first``, ``page_first_direct``) is the page's bytes exactly as a
private pool of that layout holds them (storage/pages.py stores the page run
itself). So slot ``i``'s payload *is* a pool page, only with pages
``slot_stride_bytes`` apart instead of ``bytes_per_page``: a strided view of
the mapping, in the private pool's buffer shape, lets the ordinary copy
engines (kernels/, which take every host address from strides) copy a slot
into an L1 block with no staging copy.

Invariants:
- Page ids are slot numbers; the view covers every slot, nothing else, and
  never owns the memory (the tier's mapping does; ``close`` only unpins).
- ``layer_first`` pools are refused: their objects hold pages in the
  canonical order, not the pool's, so no view of a slot is a pool page.
- On CUDA the mapping is registered (``cudaHostRegister``, portable and
  mapped) in chunks of at most ``REGISTER_CHUNK_BYTES``, so copies are DMA at
  pinned-memory speed and the Triton kernels can address it (UVA). A
  registration that fails leaves the pool pageable (``is_pinned`` False),
  as for a private pool; the caller decides whether that is acceptable.
"""

from __future__ import annotations

import logging

import torch

from vllm_hicache.host.layout import HostLayout, dtype_size
from vllm_hicache.host.layout_names import MemLayout
from vllm_hicache.host.memory import pin_range, unpin_address
from vllm_hicache.host.pool import HostKVPool

logger = logging.getLogger(__name__)

# Registration size per cudaHostRegister call: very large single ranges
# have failed on some drivers, and a chunk's failure then costs only a retry
# of the chunks before it being undone.
REGISTER_CHUNK_BYTES = 64 << 30


class SegmentKVPool(HostKVPool):
    """Pages = the payloads of the slots in ``mapping``, shaped like ``like``.

    ``first_payload_offset_bytes``: where slot 0's payload starts in
    ``mapping``; ``slot_stride_bytes``: the distance between slots.
    """

    def __init__(self, mapping: memoryview, *, num_slots: int, slot_stride_bytes: int,
                 first_payload_offset_bytes: int, like: HostKVPool,
                 pin_memory: bool = False) -> None:
        if like.mem_layout == MemLayout.LAYER_FIRST:
            raise ValueError("the node tier's slots cannot be read in place with "
                             "hicache_mem_layout=layer_first (its objects hold pages in "
                             "another order); use page_first_direct or page_first")
        self.layout = HostLayout(like.mem_layout, num_slots, like.num_layers, like.layout.order)
        self.dtype = like.dtype
        esize = dtype_size(self.dtype)
        page_bytes = self.bytes_per_page
        if slot_stride_bytes < page_bytes:
            raise ValueError(f"slots {slot_stride_bytes} bytes apart cannot hold pages of "
                             f"{page_bytes} bytes")
        if slot_stride_bytes % esize or first_payload_offset_bytes % esize:
            raise ValueError(f"slot stride {slot_stride_bytes} and payload offset "
                             f"{first_payload_offset_bytes} must be multiples of the "
                             f"{esize}-byte element")
        span_bytes = (num_slots - 1) * slot_stride_bytes + page_bytes
        if first_payload_offset_bytes + span_bytes > mapping.nbytes:
            raise ValueError(f"{num_slots} slots from offset {first_payload_offset_bytes} "
                             f"need {first_payload_offset_bytes + span_bytes} bytes; the "
                             f"mapping has {mapping.nbytes}")
        flat = torch.frombuffer(mapping, dtype=self.dtype, count=span_bytes // esize,
                                offset=first_payload_offset_bytes)
        shape = self.layout.buffer_shape
        strides = [1] * len(shape)
        for axis in range(len(shape) - 2, 0, -1):
            strides[axis] = strides[axis + 1] * shape[axis + 1]
        strides[0] = slot_stride_bytes // esize
        self.buffer = flat.as_strided(shape, strides)
        self._chunks: list[int] = []
        self._unpin = None
        self.is_pinned = False
        if pin_memory:
            self.is_pinned = self._register(mapping)

    def _register(self, mapping: memoryview) -> bool:
        base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        for start in range(0, mapping.nbytes, REGISTER_CHUNK_BYTES):
            size = min(REGISTER_CHUNK_BYTES, mapping.nbytes - start)
            if not pin_range(base + start, size, "the node tier segment"):
                self.close()
                return False
            self._chunks.append(base + start)
        return True

    def close(self) -> None:
        """Unregister the mapping (the memory stays the tier's)."""
        chunks, self._chunks = self._chunks, []
        for address in chunks:
            unpin_address(address)
        self.is_pinned = False
