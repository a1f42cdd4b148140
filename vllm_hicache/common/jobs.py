"""The wire jobs: what the scheduler half asks the workers to do, and what
they report back, in plain picklable values (no vLLM, no torch).

One set for everyone: the scheduler half builds them, ``connector/metadata``'s
envelopes carry them across processes, and the data path (``datapath/``) and
the L3 workers (``l3/worker_io``) execute them as they are.

A ``BlockCopy`` pairs L1 block ids with host page ids by position; every
job names host pages by id, identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


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


# Nothing to copy (the default of the data path's copy arguments).
NO_COPY = BlockCopy()


@dataclass(frozen=True)
class LoadJob:
    """Host pages into one request's L1 blocks; a failure fails all of them."""

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
