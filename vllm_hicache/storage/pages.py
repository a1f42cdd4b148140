"""Host pages <-> L3 objects, for one worker (one TP rank).

An object is ``header (64 B) + payload``, where the payload is the page's
bytes in the pool's layout (storage/format.py). For page-major layouts
(page_first, page_first_direct) a page is one contiguous run of the pool, so
the payload buffer *is* the pool memory (zero copy). ``layer_first`` pages
are scattered over the layers: they go through a staging copy.

With head slices (keys.HeadSlicing) a page is several objects, one per
slice of this rank's heads (``KeyNamespace.page_namespaces``), each holding
its heads in the layout's payload order (host/layout.py ``head_slice``).
One slice per page is the page itself (as above); several are copied out
and back per slice. A page counts as written or read only when every one of
its objects was.

Objects are sealed and opened by the codec (storage/sealing.py): checksums,
or with a storage secret a MAC, or authenticated encryption. It runs here,
above the backend, so every backend (user ones too) stores and returns
sealed bytes only. The MAC codec checks a batch's objects on several threads
(it releases the GIL). The encrypting codec cannot store the page itself:
each object's ciphertext goes through a per-thread scratch buffer, and
batches are cut so that scratch stays under ``SCRATCH_BYTES``.

Models with a Mamba / linear-attention state group (``page_states``): a
page's state part is valid only at some block positions, and its object says
whether. The flag is folded into the key the codec seals under (object key
+ ``#state`` or ``#no-state``, so into the header's key digest, which the
check covers): it cannot be flipped without the check failing, and a reader
that does not expect flags finds a key digest that is not its key's (a miss),
and the other way round. The object key itself has no flag, so a page is one
object whether or not its state is valid.

Reads index a page only after its object passed every check (header, key,
length, protection, checksum/MAC/tag); the result is the number of leading
pages read successfully (a prefix: L2 stays prefix-closed). An object that
the backend returned but that does not verify (corrupt, forged, or written
with another secret) is a miss, counted in ``invalid_objects`` and logged at
most once a minute. ``read_by_layer`` (a backend with byte-range reads, a
layer-major payload in clear) is the one read whose bytes reach the pool
before their check: layer by layer into the pool (page-major layouts: into
the page itself; layer_first: through one staging buffer), the checks after
the last layer on the bytes read; its result is still
the verified prefix, and its caller fails whatever it copied beyond it
(l3/same_step.py). The seconds spent opening objects are kept per calling
thread (``take_check_seconds``), so the L3 reader can tell checking from
reading (l3/hit_stages.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from vllm_hicache import io_threads
from vllm_hicache.host import HostKVPool
from vllm_hicache.host.layout_names import MemLayout
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage.base import RangedObjects, StorageBackend
from vllm_hicache.storage.batching import chunks, map_slices
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.format import (
    HEADER_BYTES,
    fields_nonce,
    header_key_digest,
    key_digest,
)
from vllm_hicache.storage.log_throttle import LogThrottle
from vllm_hicache.storage.sealing import ChecksumCodec, ObjectCodec

logger = logging.getLogger(__name__)

# Most scratch bytes one thread holds for the encrypting codec (one backend
# call's worth; a bigger batch is cut into several calls).
SCRATCH_BYTES = 64 << 20
# Most bytes of staged read payloads (layer_first, head slices) one thread
# keeps for its next read; a bigger read stages through fresh memory.
STAGING_BYTES = 64 << 20
# Most bytes (over all objects of one read) of the layers after the first
# that a layered read requests at once: a hit of a few MiB is two requests
# per object, a larger one keeps arriving layer by layer.
READ_GROUP_BYTES = 8 << 20
# Appended to an object's key to form the key it is sealed under, for stores
# with ``page_states`` (see the module doc).
_STATE_SUFFIX = {True: "#state", False: "#no-state"}
# Threads that seal and open one batch's objects at once (codecs that release
# the GIL: AES-GMAC and AES-GCM, storage/sealing.py), shared by every
# PageStore of the process.
_SEAL_THREADS = min(4, os.cpu_count() or 1)
_seal_executor: ThreadPoolExecutor | None = None
_seal_executor_lock = threading.Lock()


def _seal_pool() -> ThreadPoolExecutor:
    global _seal_executor
    with _seal_executor_lock:
        if _seal_executor is None:
            _seal_executor = ThreadPoolExecutor(_SEAL_THREADS - 1,
                                                thread_name_prefix="hicache-seal",
                                                initializer=io_threads.enter_io_thread)
        return _seal_executor


def layer_groups(num_layers: int, bytes_per_layer: int,
                 group_bytes: int) -> list[tuple[int, int]]:
    """The layer ranges [lo, hi) a layered read requests at once: layer 0
    alone, then runs of the following layers of at most ``group_bytes``
    (``bytes_per_layer``: one layer of every object of the read), at least
    one layer each."""
    per_group = max(1, group_bytes // max(1, bytes_per_layer))
    groups = [(0, min(1, num_layers))]
    lo = 1
    while lo < num_layers:
        groups.append((lo, min(num_layers, lo + per_group)))
        lo = groups[-1][1]
    return groups


def state_sealed_key(key: str, state_valid: bool) -> str:
    """The key an object of a store with ``page_states`` is sealed under."""
    return key + _STATE_SUFFIX[state_valid]


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


class PageStore:
    def __init__(self, backend: StorageBackend, pool: HostKVPool, ns: KeyNamespace,
                 codec: ObjectCodec | None = None, page_states: bool = False) -> None:
        self.backend = backend
        self.page_states = page_states
        self.pool = pool
        self.ns = ns
        self.codec = codec if codec is not None else ChecksumCodec()
        # Objects the backend returned that did not verify (see the docstring).
        self._counts = Counters("invalid_objects")
        self._invalid_log = LogThrottle()
        self._scratch = threading.local()
        # Per calling thread: seconds spent opening objects since its last take.
        self._check_s = threading.local()
        # Objects per page, in the order of this rank's heads.
        self._spaces = ns.page_namespaces()
        self._per_page = len(self._spaces)
        heads = pool.layout.order.heads
        if heads % self._per_page:
            raise ValueError(f"{heads} KV heads per page cannot be cut into "
                             f"{self._per_page} head slices")
        self._slice_heads = heads // self._per_page
        self._scratch_bytes = self.codec.scratch_bytes(self.payload_bytes)
        self._zero_copy = pool.mem_layout != MemLayout.LAYER_FIRST and self._per_page == 1
        if self._zero_copy:
            # Page p is bytes [p * page_bytes, (p + 1) * page_bytes) of the pool
            # (page-major layouts): a numpy slice per object, not a tensor view.
            self._pool_bytes = _as_bytes(pool.buffer)
            assert self._pool_bytes.nbytes == pool.num_pages * pool.bytes_per_page
            backend.register_memory(self._pool_bytes)

    @property
    def objects_per_page(self) -> int:
        """1, or the head slices each page is cut into."""
        return self._per_page

    @property
    def payload_bytes(self) -> int:
        """Bytes of one object's payload: a page, or one head slice of it."""
        return self.pool.bytes_per_page // self._per_page

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        """The keys of the pages' objects, page after page."""
        per_hash = [ns.object_keys(hashes) for ns in self._spaces]
        return [k for page_keys in zip(*per_hash) for k in page_keys]

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        return self.backend.exists_prefix(self.keys(hashes)) // self._per_page

    def write(self, hashes: Sequence[bytes], pages: Sequence[int],
              states: Sequence[bool] | None = None) -> list[bool]:
        """Store pages as objects; per-page success. ``states`` (stores with
        ``page_states``): per page, whether its state part is valid (none
        given: no page's is)."""
        keys = self.keys(hashes)
        if self.page_states:
            states = states if states is not None else [False] * len(hashes)
            assert len(states) == len(hashes), (len(states), len(hashes))
            sealed = self._sealed_keys(keys, states)
        else:
            assert states is None, "states given to a store of pages without a state part"
            sealed = keys
        payloads = self._payloads(pages)
        stored: list[bool] = []
        for lo, hi in self._chunks(len(keys)):
            stored += self._write_chunk(keys[lo:hi], sealed[lo:hi], payloads[lo:hi])
        n = self._per_page
        return [all(stored[i:i + n]) for i in range(0, len(stored), n)]

    def read(self, hashes: Sequence[bytes], pages: Sequence[int],
             states: list[bool] | None = None) -> int:
        """Fill ``pages`` from the objects of ``hashes``; leading pages read.
        ``states`` (stores with ``page_states``) gets, per page read, whether
        its state part is valid."""
        keys = self.keys(hashes)
        payloads, staged = self._read_targets(pages)
        object_states: list[bool] = []
        good = 0
        for lo, hi in self._chunks(len(keys)):
            verified = self._read_chunk(keys[lo:hi], payloads[lo:hi], object_states)
            good += verified
            if verified < hi - lo:
                break
        if good < len(keys):
            logger.debug("L3 read: %d of %d objects valid", good, len(keys))
        good_pages = good // self._per_page
        if states is not None and self.page_states:
            n = self._per_page  # a page's state is valid if all its objects say so
            states += [all(object_states[i * n:(i + 1) * n]) for i in range(good_pages)]
        if not self._zero_copy and good_pages:
            self._scatter(pages[:good_pages], payloads[:good_pages * self._per_page], staged)
        return good_pages

    @property
    def reads_by_layer(self) -> bool:
        """Can ``read_by_layer`` deliver a read layer by layer? It needs the
        layers' bytes as runs of each object (a layer-major payload: not
        page_first), one object per page, no state flags, a payload in clear
        (not the encrypting codec) and a backend that reads byte ranges."""
        return (self.pool.layout.layer_payload_axes() is not None and self._per_page == 1
                and not self.page_states and self._scratch_bytes == 0
                and type(self.backend).open_ranged is not StorageBackend.open_ranged)

    def read_by_layer(self, hashes: Sequence[bytes], pages: Sequence[int],
                      on_layer: Callable[[int, int], None]) -> int:
        """As ``read``, delivered layer by layer (needs ``reads_by_layer``):
        ``on_layer(layer, num_pages)`` runs once per layer, in order, when
        that layer of the leading ``num_pages`` pages is in the pool (never
        more pages than for the layer before). Those bytes are NOT verified
        yet: every object's check runs after its last layer, and only the
        result, the leading pages that passed it, may be indexed or kept
        (the L1 copies made from the rest must be failed).

        Requests per object: its header with layer 0 (so the forward's first
        layer waits for as little as possible), then each group of the
        following layers (``layer_groups``): two for a hit of a few MiB,
        one per layer for a large one, which keeps streaming."""
        assert self.reads_by_layer, "read_by_layer on a store that cannot"
        keys = self.keys(hashes)
        ranged = self.backend.open_ranged(keys, self.object_bytes)
        assert ranged is not None
        size, layers = self.payload_bytes, self.pool.num_layers
        layer_bytes = size // layers
        try:
            n = ranged.num_opened
            # Page-major layouts: the pool pages themselves, each layer group in
            # the pool as soon as it is read. layer_first: staging rows, copied
            # into the pool layer by layer (its payload is in canonical order,
            # which need not be the pool's).
            objects, flat = self._read_targets(pages[:n])
            staged = None if flat is None else flat.reshape(n, size)
            headers = self._kept("headers", n * HEADER_BYTES).reshape(n, HEADER_BYTES)
            n = self._read_first_layer(ranged, keys, headers,
                                       [obj[:layer_bytes] for obj in objects])
            for lo, hi in layer_groups(layers, n * layer_bytes, READ_GROUP_BYTES):
                begin, end = lo * layer_bytes, hi * layer_bytes
                if lo:
                    n = next((i for i in range(n) if not ranged.read(
                        i, HEADER_BYTES + begin, objects[i][begin:end])), n)
                for layer in range(lo, hi):
                    at = layer * layer_bytes
                    if n and staged is not None:
                        self.pool.write_layer_payloads(
                            layer, pages[:n], torch.from_numpy(staged[:n, at:at + layer_bytes]))
                    on_layer(layer, n)
        finally:
            ranged.close()
        payloads = objects[:n]
        good = self._open_objects(keys, keys, list(headers[:n]), payloads, payloads,
                                  [None] * n, n)
        if good < len(keys):
            logger.debug("L3 read by layer: %d of %d objects valid", good, len(keys))
        return good

    def _read_first_layer(self, ranged: RangedObjects, keys: list[str], headers: np.ndarray,
                          first_layers: list[np.ndarray]) -> int:
        """Read the opened objects' headers and first layers (one request
        each); the leading ones read whose header is what this reader
        expects. A header that is not fails its object now, before any of
        its layers reaches L1 (the check proper comes last)."""
        for i in range(len(headers)):
            if not ranged.read_vectored(i, 0, [headers[i], first_layers[i]]):
                return i
            if fields_nonce(headers[i], keys[i], self.payload_bytes,
                            self.codec.protection) is None:
                self._note_invalid(keys[i])
                return i
        return len(headers)

    def take_check_seconds(self) -> float:
        """Seconds this thread's reads spent opening objects since its last take."""
        total = getattr(self._check_s, "total", 0.0)
        self._check_s.total = 0.0
        return total

    @property
    def invalid_objects(self) -> int:
        return self._counts["invalid_objects"]

    def stats(self) -> dict[str, float]:
        return self._counts.snapshot()

    def _write_chunk(self, keys: list[str], sealed: list[str],
                     payloads: list[np.ndarray]) -> list[bool]:
        """Seal (under ``sealed`` keys) and put one backend call's objects;
        per-object success."""
        scratch = self._scratch_buffers(len(keys))
        headers = [np.empty(HEADER_BYTES, np.uint8) for _ in keys]
        bodies = self._each(len(keys), lambda i: self.codec.seal(
            sealed[i], payloads[i], headers[i], scratch[i]))
        return self.backend.put(keys, [list(hb) for hb in zip(headers, bodies)])

    def _read_chunk(self, keys: list[str], payloads: list[np.ndarray],
                    states: list[bool]) -> int:
        """Read and open one backend call's objects; leading objects valid
        (their state flags appended to ``states`` for stores with
        ``page_states``)."""
        scratch = self._scratch_buffers(len(keys))
        headers = [np.empty(HEADER_BYTES, np.uint8) for _ in keys]
        bodies = [self.codec.body(p, buf) for p, buf in zip(payloads, scratch)]
        found = self.backend.get(keys, [[h, b] for h, b in zip(headers, bodies)])
        n = next((i for i, fine in enumerate(found) if not fine), len(keys))
        if self.page_states:
            # Which of the two keys an object claims to be sealed under; the
            # codec then checks that claim with everything else.
            with_state = [
                header_key_digest(headers[i]) == key_digest(state_sealed_key(keys[i], True))
                for i in range(n)
            ]
            sealed = [state_sealed_key(k, flag) for k, flag in zip(keys, with_state)]
        else:
            sealed = keys
        n = self._open_objects(keys, sealed, headers, bodies, payloads, scratch, n)
        if self.page_states:
            states += with_state[:n]
        return n

    def _open_objects(self, keys: list[str], sealed: list[str], headers: list[np.ndarray],
                      bodies: list[np.ndarray], payloads: list[np.ndarray],
                      scratch: list[np.ndarray | None], n: int) -> int:
        """Check (and decrypt) the first ``n`` objects read; leading ones valid."""
        check_started = time.perf_counter()
        opened = self._each(n, lambda i: self.codec.open(
            sealed[i], headers[i], bodies[i], payloads[i], scratch[i]))
        self._check_s.total = (getattr(self._check_s, "total", 0.0)
                               + time.perf_counter() - check_started)
        for i, ok in enumerate(opened):
            if not ok:
                self._note_invalid(keys[i])
                return i
        return n

    def _sealed_keys(self, keys: list[str], states: Sequence[bool]) -> list[str]:
        """The keys objects are sealed under: the object key and the page's
        state flag (see the module doc)."""
        n = self._per_page
        return [state_sealed_key(k, bool(states[i // n])) for i, k in enumerate(keys)]

    def _note_invalid(self, key: str) -> None:
        count = self._counts.bump("invalid_objects")
        if not self._invalid_log.ready():
            return
        logger.warning(
            "HiCache L3 (backend %r): object %s did not verify (%s) and is a miss; %d so "
            "far. Corrupt, or written by someone without this instance's storage_secret",
            self.backend.name, key, self.codec.name, count,
        )

    # --- batches and scratch -------------------------------------------------

    def _each(self, n: int, fn: Callable[[int], Any]) -> list[Any]:
        """``[fn(i) for i in range(n)]``; for a codec that releases the GIL,
        spread in contiguous slices over the seal threads (this one runs the
        first), so checking a batch scales with the cores."""
        workers = _SEAL_THREADS if self.codec.releases_gil else 1
        return map_slices(fn, range(n), workers, _seal_pool)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) ranges of one backend call each: the whole batch, unless
        the codec needs scratch (then at most SCRATCH_BYTES of it per call)."""
        spans = chunks([self._scratch_bytes] * n, max_bytes=SCRATCH_BYTES)
        return [(span.start, span.stop) for span in spans]

    def _scratch_buffers(self, count: int) -> list[np.ndarray | None]:
        """``count`` scratch buffers of this thread (reused: fresh memory
        would be page-faulted on every call)."""
        size = self._scratch_bytes
        if not size:
            return [None] * count
        arena = self._kept("arena", count * size)
        return [arena[i * size:(i + 1) * size] for i in range(count)]

    def _kept(self, name: str, nbytes: int) -> np.ndarray:
        """``nbytes`` of this thread's buffer ``name``, kept for its next
        call (grown when short)."""
        flat = getattr(self._scratch, name, None)
        if flat is None or flat.nbytes < nbytes:
            flat = np.empty(nbytes, np.uint8)
            setattr(self._scratch, name, flat)
        return flat[:nbytes]

    # --- payload buffers ---------------------------------------------------

    def _payloads(self, pages: Sequence[int]) -> list[np.ndarray]:
        """One buffer per object, page after page."""
        if self._zero_copy:
            return self._page_views(pages)
        if self._per_page > 1:
            return [_as_bytes(view) for p in pages for view in self._slices(p)]
        staged = self.pool.read_pages(list(pages))
        return [_as_bytes(staged[i]) for i in range(len(pages))]

    def _page_views(self, pages: Sequence[int]) -> list[np.ndarray]:
        size, whole = self.pool.bytes_per_page, self._pool_bytes
        return [whole[p * size:(p + 1) * size] for p in pages]

    def _read_targets(self, pages: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray | None]:
        """One buffer per object to read into, and (staged layouts) the one
        flat buffer they are consecutive slices of."""
        if self._zero_copy:
            # Zero copy means a failed read may leave garbage in the page;
            # harmless: the page is not indexed unless the read verified.
            return self._page_views(pages), None
        size = self.payload_bytes
        count = len(pages) * self._per_page
        flat = self._staging(count * size)
        return [flat[i * size:(i + 1) * size] for i in range(count)], flat

    def _staging(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of this thread's staging memory, kept between reads up
        to ``STAGING_BYTES`` (fresh memory is page-faulted on every read)."""
        if nbytes > STAGING_BYTES:
            return np.empty(nbytes, np.uint8)
        return self._kept("staging", nbytes)

    def _slices(self, page: int) -> list[torch.Tensor]:
        """Views of ``page``'s head slices, in payload order."""
        layout, heads = self.pool.layout, self._slice_heads
        return [layout.head_slice(self.pool.buffer, page, j * heads, heads)
                for j in range(self._per_page)]

    def _scatter(self, pages: Sequence[int], payloads: list[np.ndarray],
                 staged: np.ndarray | None) -> None:
        """Copy staged payloads into their pages (``staged``: the flat buffer
        the payloads are consecutive slices of)."""
        if self._per_page > 1:
            views = [view for p in pages for view in self._slices(p)]
            for view, payload in zip(views, payloads):
                view.copy_(torch.from_numpy(payload).view(self.pool.dtype).view(view.shape))
            return
        assert staged is not None
        # The pages' payloads side by side already: one copy into the pool.
        data = torch.from_numpy(staged[:len(pages) * self.payload_bytes]).view(self.pool.dtype)
        self.pool.write_pages(list(pages), data.view(len(pages), *self.pool.canonical_page_shape))
