"""The L3 storage interface every backend implements.

An L3 *object* holds one host page (one vLLM block of all layers, of this
rank) plus a fixed-size header (see storage/format.py). Backends store opaque
objects under string keys; they never interpret the bytes. An object is read
and written as a short list of buffers whose concatenation is the object
(header buffer, then the page's payload buffer(s)), so engines with
scatter/gather or registered memory can move it without an extra copy.

Buffers are 1-D contiguous ``numpy.uint8`` arrays: they expose the buffer
protocol (files, sockets) and their address (``.ctypes.data``, for engines
that take pointers).

Failure is data, not an exception: a key that cannot be read or written is a
``False`` in the per-key result, so one broken object or a backend outage
costs a miss, never a failed request. Only construction may raise (bad
options, unreachable backend at start).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import numpy as np

# A forward reference: this module (and the registry) import without numpy,
# so the configuration layer can name the registered backends.
Buffers = Sequence["np.ndarray"]


@dataclass(frozen=True)
class StorageContext:
    """What a backend may know about the process that built it."""

    # "scheduler" (existence queries only) or "worker" (reads and writes).
    role: str
    # This worker's TP rank (0 on the scheduler) and the TP size.
    tp_rank: int
    tp_size: int
    # Bytes of one object (header + payload): backends may size buffers/files.
    object_bytes: int


class StorageBackend(ABC):
    """One client of an L3 store.

    Built once per process that needs it: by the scheduler half for
    ``exists_prefix`` (called from its lookup thread) and by every worker for
    ``get``/``put`` (called from its I/O threads). Every method may run
    concurrently from several threads, so implementations are thread-safe.
    """

    # Registry name ("file", "redis", ...), for logs and errors.
    name: ClassVar[str]

    @abstractmethod
    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        """Parse ``options`` (this backend's part of
        ``hicache_storage_backend_extra_config``) into a frozen config, raising
        ValueError naming any unknown or malformed key, and connect; an
        unreachable backend raises within 30 s naming the backend and address."""

    @abstractmethod
    def exists_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` that are stored (stops at the first miss)."""

    @abstractmethod
    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        """Read object ``keys[i]`` into ``targets[i]`` (filled in order). True only
        if the object exists and is exactly as long as the buffers together;
        a False entry leaves its buffers in an unspecified state."""

    @abstractmethod
    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        """Store ``sources[i]`` concatenated as object ``keys[i]``. Readers must
        never see a partial object. False: not stored (full, error)."""

    def register_memory(self, region: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Hook: ``region`` (the host pool) will contain get/put buffers for the
        backend's lifetime. Zero-copy engines register it; default: nothing."""

    def open_ranged(self, keys: Sequence[str], object_bytes: int) -> RangedObjects | None:
        """Objects ``keys`` opened for reads of byte ranges, or None: this
        backend reads whole objects only (the default). Called by a worker's
        I/O thread that reads a hit layer by layer (storage/pages.py
        ``read_by_layer``); only the leading objects that exist and are
        exactly ``object_bytes`` long are opened."""
        return None

    @abstractmethod
    def clear(self) -> None:
        """Remove every object this backend can see (admin API)."""

    def stats(self) -> dict[str, float]:
        """Counters for logs/metrics; default: none."""
        return {}

    def take_removed_keys(self) -> list[str]:
        """Keys of objects removed since the last call, known exactly: ones
        this client evicted itself, or the store reported removing. For
        KV events (l3/removals.py); default: none known."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads; idempotent."""


class RangedObjects(ABC):
    """Leading objects of one read, open for reads of byte ranges
    (``StorageBackend.open_ranged``). Used by the one thread that opened
    them, which must ``close`` them; an object may be replaced meanwhile
    (a put), and a range read from it then either fails or returns bytes
    of one version, which the object's check catches (storage/format.py)."""

    @property
    @abstractmethod
    def num_opened(self) -> int:
        """Leading keys opened (each exactly ``object_bytes`` long)."""

    @abstractmethod
    def read(self, index: int, offset: int, buffer: np.ndarray) -> bool:
        """Fill ``buffer`` with bytes [offset, offset + len) of opened object
        ``index``; False if they could not all be read."""

    def read_vectored(self, index: int, offset: int, buffers: Sequence[np.ndarray]) -> bool:
        """Fill ``buffers``, in order, with the consecutive bytes of opened
        object ``index`` from ``offset`` on; False if they could not all be
        read. Backends that can do it in one request override this."""
        for buffer in buffers:
            if not self.read(index, offset, buffer):
                return False
            offset += buffer.nbytes
        return True

    @abstractmethod
    def close(self) -> None:
        """Release the objects; idempotent."""
