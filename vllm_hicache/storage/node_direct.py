"""When a node-tier slot can be copied into L1 in place, and how its object
is checked there.

A slot holds one L3 object (storage/format.py: 64-byte header, payload) as
``PageStore`` sealed it. Read in place, the payload must already be the
page, byte for byte as the pool holds it, and opening the object must not
write anything (the segment is shared: a reader never changes it). That
rules out, each named by ``direct_read_blocker``:
- encrypted objects (``storage_secret`` with encryption): the payload is
  ciphertext, opened into a scratch buffer;
- head slices (heterogeneous TP): a page is several objects;
- pages with a state part (hybrid models with Mamba groups): the key an
  object is sealed under depends on a flag the reader learns from it;
- ``layer_first`` pools: their objects hold pages in the canonical order.
Those instances keep loading node-tier hits through the private L2.

Who checks a slot's object, and when (the tier's trust rule):
- Every object is checked once, by the member that publishes it: a backup
  is the publisher's own encoding of its L2 page, and an object promoted
  from the remote store is opened by the codec before it is sealed
  (``promotion_check``, which the chain backend runs); one that fails is
  never published. A direct load then checks seals only (generation and
  key, before and after the copy): the trust a private L2 page gets once it
  was read, and the reason a cross-instance hit costs no pass over its
  bytes.
- With ``storage_secret`` (a MAC), the promise is that nobody without the
  secret places KV; whoever can write the tier's directory could write a
  slot and its seal, so each process opens a slot's object, read-only in
  place, the first time it reads that slot at that generation
  (``object_check``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_hicache.host.layout_names import MemLayout
from vllm_hicache.storage.base import Buffers
from vllm_hicache.storage.pages import PageStore
from vllm_hicache.storage.sealing import ChecksumCodec

# (object key, header bytes, payload bytes) -> whether the object is valid.
ObjectCheck = Callable[[str, np.ndarray, np.ndarray], bool]
# (object key, the object as read: header, payload) -> whether it is valid.
PromotionCheck = Callable[[str, Buffers], bool]


def config_blocker(mem_layout: str, objects_per_page: int, page_states: bool,
                   encrypted: bool) -> str | None:
    """Why objects of this configuration cannot be read in place (None: they
    can). The scheduler half asks before it sends a direct load; the worker
    asks ``direct_read_blocker``, which checks the same and its store."""
    if mem_layout == MemLayout.LAYER_FIRST:
        return "hicache_mem_layout=layer_first stores pages in another order than the pool's"
    if objects_per_page != 1:
        return f"each page is {objects_per_page} objects (head slices)"
    if page_states:
        return "pages carry a state part (hybrid model)"
    if encrypted:
        return "objects are encrypted (storage_encrypt)"
    return None


def direct_read_blocker(store: PageStore, slot_bytes: int) -> str | None:
    """Why ``store``'s objects cannot be loaded from node-tier slots of
    ``slot_bytes`` in place (None: they can)."""
    blocker = config_blocker(store.pool.mem_layout, store.objects_per_page, store.page_states,
                             bool(store.codec.scratch_bytes(store.payload_bytes)))
    if blocker is not None:
        return blocker
    if slot_bytes != store.object_bytes:
        return f"node tier pages of {slot_bytes} bytes hold no object of {store.object_bytes}"
    return None


def object_check(store: PageStore) -> ObjectCheck | None:
    """The check a direct load runs on a slot it reads for the first time
    (after ``direct_read_blocker`` said None): the MAC, opened read-only in
    place; None for checksum objects, which their publisher checked."""
    codec = store.codec
    if isinstance(codec, ChecksumCodec):
        return None

    def check(key: str, header: np.ndarray, payload: np.ndarray) -> bool:
        return codec.open(key, header, payload, payload)

    return check


def promotion_check(store: PageStore) -> PromotionCheck | None:
    """The check of an object read from the remote store before it is
    sealed into the node tier, for stores whose pages are loaded in place
    (None: the store's objects are never read in place, and every read of
    them through L2 checks them)."""
    if config_blocker(store.pool.mem_layout, store.objects_per_page, store.page_states,
                      bool(store.codec.scratch_bytes(store.payload_bytes))) is not None:
        return None
    codec = store.codec

    def check(key: str, buffers: Buffers) -> bool:
        if len(buffers) != 2:  # (header, payload) as PageStore reads them
            return False
        header, payload = buffers
        return codec.open(key, header, payload, payload)

    return check
