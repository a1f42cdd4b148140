"""Wire types between the two halves of the connector.

Scheduler -> workers, once per step: ``HiCacheMetadata``. Its operations are
executed by every worker in this order, and step N's operations finish before
step N+1's start (stores of step N before loads of step N+1):

1. ``evict_stores``: write-back copies L1 -> L2 of blocks vLLM is handing to
   new requests this step; run before the forward overwrites them.
2. ``loads``: L2 -> L1 for requests scheduled this step (layer by layer in
   layerwise mode, overlapped with the forward).
3. ``async_loads``: L2 -> L1 for requests waiting in WAITING_FOR_REMOTE_KVS;
   completion is reported through ``get_finished``.
4. ``stores``: write-through copies L1 -> L2 of blocks completed by this
   step's forward; run after the forward.

Everything here must pickle: it crosses from EngineCore to the workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class BlockCopy:
    """Pairs of (vLLM block id, host page id), matched by position."""

    block_ids: tuple[int, ...] = ()
    page_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.page_ids), (
            len(self.block_ids),
            len(self.page_ids),
        )

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class LoadJob:
    """Load host pages into one request's blocks."""

    req_id: str
    copy: BlockCopy


@dataclass(frozen=True)
class PrefetchJob:
    """Read L3 objects of ``hashes`` into host ``pages`` (L3 -> L2)."""

    op_id: int
    hashes: tuple[bytes, ...]
    pages: tuple[int, ...]


@dataclass(frozen=True)
class BackupJob:
    """Write host ``pages`` to L3 under ``hashes`` (L2 -> L3), after this
    step's stores have filled them. ``states``: per page, whether its state
    part is valid (models with a state group, page_states.py; else empty)."""

    op_id: int
    hashes: tuple[bytes, ...]
    pages: tuple[int, ...]
    states: tuple[bool, ...] = ()


class PrefetchProgress(NamedTuple):
    """One rank's progress on one prefetch op."""

    done: int           # leading pages verified and written into L2
    finished: bool      # nothing more will come
    # Of those, the pages (indices into the job's pages) whose state part is
    # valid (models with a state group; else empty).
    state_pages: frozenset[int] = frozenset()


@dataclass(frozen=True)
class StorageCommand:
    """Attach or detach this rank's L3 client (admin API; admin/storage_control.py).
    Run first, before any other operation of its step; acknowledged in
    ``HiCacheWorkerMetadata.storage_acks``. ``storage_keys``: the
    ``hicache_storage_*`` keys, as kv_connector_extra_config holds them, that
    each worker parses as it does at start (may hold a secret: never shown)."""

    cmd_id: int
    action: str  # "attach" | "detach"
    storage_keys: dict | None = field(default=None, repr=False)
    # attach: two free host pages the start canary may use (l3_canary).
    canary_pages: tuple[int, int] | None = None


@dataclass
class HiCacheMetadata(KVConnectorMetadata):
    evict_stores: BlockCopy = field(default_factory=BlockCopy)
    loads: list[LoadJob] = field(default_factory=list)
    async_loads: list[LoadJob] = field(default_factory=list)
    stores: BlockCopy = field(default_factory=BlockCopy)
    prefetches: list[PrefetchJob] = field(default_factory=list)
    backups: list[BackupJob] = field(default_factory=list)
    storage_command: StorageCommand | None = None

    def is_empty(self) -> bool:
        return not (
            self.evict_stores or self.loads or self.async_loads or self.stores
            or self.prefetches or self.backups or self.storage_command
        )


@dataclass
class HiCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step; vLLM merges the ranks' copies.

    ``prefetch``: op -> rank -> PrefetchProgress;
    ``backups``: op -> ranks that finished it;
    ``failed_store_pages``: host pages whose L1 -> L2 store raised on some
    rank since its last report. Their bytes are garbage on that rank, so the
    scheduler must drop them from the index (a page is only as good as its
    worst rank).
    ``storage_acks``: StorageCommand id -> rank -> error ("" = done).
    ``backup_failures``: backup op -> hashes some rank did not get into L3
    (reported no later than that rank's ack; for KV events)."""

    prefetch: dict[int, dict[int, PrefetchProgress]] = field(default_factory=dict)
    backups: dict[int, set[int]] = field(default_factory=dict)
    failed_store_pages: set[int] = field(default_factory=set)
    storage_acks: dict[int, dict[int, str]] = field(default_factory=dict)
    backup_failures: dict[int, set[bytes]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HiCacheWorkerMetadata:
        assert isinstance(other, HiCacheWorkerMetadata)
        for op_id, by_rank in other.prefetch.items():
            self.prefetch.setdefault(op_id, {}).update(by_rank)
        for op_id, ranks in other.backups.items():
            self.backups.setdefault(op_id, set()).update(ranks)
        self.failed_store_pages |= other.failed_store_pages
        for cmd_id, by_rank in other.storage_acks.items():
            self.storage_acks.setdefault(cmd_id, {}).update(by_rank)
        for op_id, hashes in other.backup_failures.items():
            self.backup_failures.setdefault(op_id, set()).update(hashes)
        return self


class BlockPage(NamedTuple):
    """One block to copy between its L1 block and its L2 page."""

    block_id: int
    page: int


def merge_copies(pairs: Sequence[BlockPage]) -> BlockCopy:
    """One BlockCopy for a step's block/page pairs."""
    if not pairs:
        return BlockCopy()
    blocks, pages = zip(*pairs)
    return BlockCopy(tuple(blocks), tuple(pages))
