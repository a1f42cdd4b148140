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

Checksum and MAC objects are opened read-only: ``object_check`` returns a
function that checks header + payload as they sit in the segment against
the object key, exactly as ``PageStore.read`` would after copying them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_hicache.host.layout_names import MemLayout
from vllm_hicache.storage.pages import PageStore

# (object key, header bytes, payload bytes) -> whether the object is valid.
ObjectCheck = Callable[[str, np.ndarray, np.ndarray], bool]


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


def object_check(store: PageStore) -> ObjectCheck:
    """The read-only check of one object in place (after ``direct_read_blocker``
    said None)."""
    codec = store.codec

    def check(key: str, header: np.ndarray, payload: np.ndarray) -> bool:
        return codec.open(key, header, payload, payload)

    return check
