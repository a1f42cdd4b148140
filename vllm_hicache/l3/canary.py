"""Start-up canary: one page of known bytes through this worker's L3 path.

Checksums make a corrupt object a miss, but they cannot see a path that
stores the wrong bytes consistently (a backend or engine that places,
transforms or mixes up buffers, a payload assembled from the wrong memory):
the object then verifies and loads as wrong KV. So before any request runs,
each worker writes one page of a pattern derived from its namespace tag
through ``PageStore.write``, reads it back through ``PageStore.read`` into
another page, and compares bytes.

    passed       L3 as configured
    unavailable  the write failed, or the object cannot be read back (two
                 tries) while the store holds it intact or not at all: an
                 outage, a flaky or full store costs misses, never a failed
                 start; warning, L3 stays on
    failed       the object is there but does not come back as written:
                 error naming the backend and the namespace; L3 is off for
                 this worker (``DisabledPageStore``: reads miss, writes are
                 skipped, the scheduler's ops still complete)

Scratch pages: at start the canary writes host pages 0 and ``num_pages - 1``
and zeroes them again. That is safe because it runs while the worker
registers its KV caches: no page is indexed (the scheduler hands out pages
only in metadata of steps that come later) and no L3 job exists yet. An L3
attached at run time (admin API, admin/storage_control.py) finds L2 in use: there the
scheduler half allocates two free pages for the canary and passes them in.

The object key is this namespace's key of a reserved block hash,
``CANARY_MARK`` + 16 bytes of sha256(tag, TP rank): 32 bytes like vLLM's
sha256 block hashes, which start with these 16 bytes with probability
2^-128. Each restart overwrites it; ``is_canary_key`` tells it apart (and
the L3 breaker's health-check object, l3/health_check.py, under the same mark).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hicache.host import HostKVPool
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage.base import StorageBackend
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.pages import PageStore

logger = logging.getLogger(__name__)

CANARY_MARK = b"hicache-canary\x00\x00"
_PATTERN_DOMAIN = b"hicache-canary-pattern\x00"

PASSED, UNAVAILABLE, FAILED = "passed", "unavailable", "failed"


def canary_hash(ns: KeyNamespace) -> bytes:
    # The TP rank: MLA ranks share a tag, and each must test its own path.
    # With head slices instances of other TP sizes share the tag too (and
    # would write other bytes under it): the TP size keeps theirs apart.
    rank = f"{ns.tp_rank}|tp{ns.tp_size}" if ns.head_slices else f"{ns.tp_rank}"
    digest = hashlib.sha256(b"hicache-canary" + f"{ns.tag}|{rank}".encode()).digest()
    return CANARY_MARK + digest[:16]


def is_canary_key(key: str) -> bool:
    return f"-{CANARY_MARK.hex()}" in key


def canary_pattern(ns: KeyNamespace, num_bytes: int) -> bytes:
    """Pseudo-random bytes: a misplaced or reordered run shows, and no two
    namespaces write the same page."""
    return hashlib.shake_256(_PATTERN_DOMAIN + ns.tag.encode()).digest(num_bytes)


@dataclass(frozen=True)
class CanaryResult:
    outcome: str  # PASSED | UNAVAILABLE | FAILED
    detail: str


def run_canary(pages: PageStore, scratch: tuple[int, int] | None = None) -> CanaryResult:
    """Round-trip one page through ``pages`` using the two ``scratch`` pages
    (default: the first and last page, for a pool nothing uses yet)."""
    pool = pages.pool
    src, dst = scratch if scratch is not None else (0, pool.num_pages - 1)
    hashes = [canary_hash(pages.ns)]
    expected = torch.frombuffer(
        bytearray(canary_pattern(pages.ns, pool.bytes_per_page)), dtype=torch.uint8
    )
    try:
        _page_bytes(pool, src).copy_(expected.view(_page_bytes(pool, src).shape))
        try:
            written = pages.write(hashes, [src])
        except Exception as e:  # noqa: BLE001 - a backend error is an outage here
            return CanaryResult(UNAVAILABLE, f"write raised {e!r}")
        if not all(written):
            return CanaryResult(UNAVAILABLE, "write refused")
        # A second try: one failed get of a flaky store is not a verdict.
        for _ in range(2):
            _page_bytes(pool, dst).zero_()
            try:
                good = pages.read(hashes, [dst])
            except Exception as e:  # noqa: BLE001
                return CanaryResult(UNAVAILABLE, f"read raised {e!r}")
            if good == 1:
                if torch.equal(_page_bytes(pool, dst).reshape(-1), expected):
                    return CanaryResult(PASSED, "")
                return CanaryResult(FAILED, "the object verified but holds other bytes")
        return _diagnose_unreadable(pages, hashes)
    finally:
        _page_bytes(pool, src).zero_()
        _page_bytes(pool, dst).zero_()


def _diagnose_unreadable(pages: PageStore, hashes: Sequence[bytes]) -> CanaryResult:
    """The page did not verify: missing (an outage), or present but altered?
    (Each of its objects: one, or one per head slice.)"""
    codec = pages.codec
    for key in pages.keys(hashes):
        header = np.empty(HEADER_BYTES, np.uint8)
        payload = np.empty(pages.payload_bytes, np.uint8)
        extra = codec.scratch_bytes(payload.nbytes)
        scratch = np.empty(extra, np.uint8) if extra else None
        body = codec.body(payload, scratch)
        try:
            found = pages.backend.get([key], [[header, body]])[0]
        except Exception as e:  # noqa: BLE001
            return CanaryResult(UNAVAILABLE, f"written, then unreadable: get raised {e!r}")
        if not found:
            return CanaryResult(UNAVAILABLE, "written, then not found")
        if not codec.open(key, header, body, payload, scratch):
            return CanaryResult(FAILED, f"the object comes back with other bytes (header or "
                                        f"{codec.name} mismatch)")
    # Intact, yet the page path keeps missing it: misses, not wrong KV.
    return CanaryResult(UNAVAILABLE, "written and intact, but page reads fail")


def _page_bytes(pool, page: int) -> torch.Tensor:
    """The page's bytes in canonical element order (a strided view)."""
    return pool.cells()[page].view(torch.uint8)


def guard_with_canary(pages: PageStore,
                      scratch: tuple[int, int] | None = None) -> PageStore | DisabledPageStore:
    """Run the canary (on ``scratch`` pages, see run_canary); ``pages``
    unless it failed."""
    result = run_canary(pages, scratch)
    backend, tag = pages.backend.name, pages.ns.tag
    if result.outcome == PASSED:
        logger.info("HiCache L3: canary passed (backend %r, namespace %s)", backend, tag)
        return pages
    if result.outcome == UNAVAILABLE:
        logger.warning(
            "HiCache L3: canary not checked (backend %r, namespace %s): %s; L3 stays on "
            "(an unreachable store costs misses)", backend, tag, result.detail,
        )
        return pages
    reason = (
        f"canary failed: {result.detail}. The backend or its configuration does not "
        "return the bytes written, so L3 would serve wrong KV"
    )
    logger.error(
        "HiCache L3 disabled on this worker (backend %r, namespace %s): %s; reads are "
        "misses and writes are skipped", backend, tag, reason,
    )
    return DisabledPageStore(pages, reason)


class DisabledPageStore:
    """Stands in for a PageStore this worker must not use: every read is a
    miss and every write is skipped, so prefetches report 0 pages and
    backups are still acknowledged. Anything else (backend, for shutdown)
    is the wrapped store's."""

    def __init__(self, pages: PageStore, reason: str) -> None:
        self.wrapped = pages
        self.reason = reason

    def __getattr__(self, name: str):
        return getattr(self.wrapped, name)

    # Spelled out for type checkers (StorageIO's PageTier); __getattr__ covers the rest.
    @property
    def pool(self) -> HostKVPool:
        return self.wrapped.pool

    @property
    def backend(self) -> StorageBackend:
        return self.wrapped.backend

    def stats(self) -> dict[str, float]:
        return self.wrapped.stats()

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        # "Nothing stored" makes a backup try to write, which is skipped.
        return 0

    def write(self, hashes: Sequence[bytes], pages: Sequence[int],
              states: Sequence[bool] | None = None) -> list[bool]:
        return [False] * len(hashes)

    def read(self, hashes: Sequence[bytes], pages: Sequence[int],
             states: list[bool] | None = None) -> int:
        return 0

    reads_by_layer = False

    def read_by_layer(self, hashes: Sequence[bytes], pages: Sequence[int],
                      on_layer: Callable[[int, int], None]) -> int:
        raise AssertionError("read_by_layer on a disabled L3")

    def take_check_seconds(self) -> float:
        return 0.0
