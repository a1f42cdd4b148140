"""Host pages <-> L3 objects, for one worker (one TP rank).

An object is ``header (64 B) + payload``, where the payload is the page's
bytes in the pool's layout (storage/format.py). For page-major layouts
(page_first, page_first_direct) a page is one contiguous run of the pool, so
the payload buffer *is* the pool memory (zero copy). ``layer_first`` pages
are scattered over the layers: they go through a staging copy.

Reads write a page only after its object passed every check (header, key,
length, checksum), so a bad object never reaches the pool; the result is the
number of leading pages read successfully (a prefix: L2 stays prefix-closed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from vllm_hicache.host import HostKVPool
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage.base import StorageBackend
from vllm_hicache.storage.format import HEADER_BYTES, encode_header, header_matches

logger = logging.getLogger(__name__)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


class PageStore:
    def __init__(self, backend: StorageBackend, pool: HostKVPool, ns: KeyNamespace) -> None:
        self.backend = backend
        self.pool = pool
        self.ns = ns
        self._zero_copy = pool.mem_layout != "layer_first"
        if self._zero_copy:
            backend.register_memory(_as_bytes(pool.buffer))

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.pool.bytes_per_page

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        return self.ns.object_keys(hashes)

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        return self.backend.exists_prefix(self.keys(hashes))

    def write(self, hashes: Sequence[bytes], pages: Sequence[int]) -> list[bool]:
        """Store pages as objects; per-page success."""
        keys = self.keys(hashes)
        payloads = self._payloads(pages)
        sources = [[encode_header(k, p), p] for k, p in zip(keys, payloads)]
        return self.backend.put(keys, sources)

    def read(self, hashes: Sequence[bytes], pages: Sequence[int]) -> int:
        """Fill ``pages`` from the objects of ``hashes``; leading pages read."""
        keys = self.keys(hashes)
        headers = [np.empty(HEADER_BYTES, np.uint8) for _ in keys]
        payloads = self._read_targets(pages)
        ok = self.backend.get(keys, [[h, p] for h, p in zip(headers, payloads)])
        good = 0
        for key, header, payload, fine in zip(keys, headers, payloads, ok):
            if not (fine and header_matches(header, key, payload)):
                break
            good += 1
        if good < len(keys):
            logger.debug("L3 read: %d of %d objects valid", good, len(keys))
        if not self._zero_copy and good:
            self._scatter(pages[:good], payloads[:good])
        return good

    # --- payload buffers ---------------------------------------------------

    def _payloads(self, pages: Sequence[int]) -> list[np.ndarray]:
        if self._zero_copy:
            return [_as_bytes(self.pool.page_run(p)) for p in pages]
        staged = self.pool.read_pages(list(pages))
        return [_as_bytes(staged[i]) for i in range(len(pages))]

    def _read_targets(self, pages: Sequence[int]) -> list[np.ndarray]:
        if self._zero_copy:
            # Zero copy means a failed read may leave garbage in the page;
            # harmless: the page is not indexed unless the read verified.
            return [_as_bytes(self.pool.page_run(p)) for p in pages]
        return [np.empty(self.pool.bytes_per_page, np.uint8) for _ in pages]

    def _scatter(self, pages: Sequence[int], payloads: list[np.ndarray]) -> None:
        shape = self.pool.canonical_page_shape
        data = torch.stack([
            torch.from_numpy(p).view(self.pool.dtype).view(shape) for p in payloads
        ])
        self.pool.write_pages(list(pages), data)
