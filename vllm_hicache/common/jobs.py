"""The wire jobs: what the scheduler half asks the workers to do, and what
they report back, in plain picklable values (no vLLM, no torch).

One set for everyone: the scheduler half builds them, ``connector/metadata``'s
envelopes carry them across processes, and the data path (``datapath/``) and
the L3 workers (``l3/worker_io``) execute them as they are.

A ``BlockCopy`` pairs L1 block ids with host page ids by position; every
job names host pages by id, identical on every rank. L3 jobs name the
backend generation they belong to (the admin API may replace the backend
while they run): a rank runs each on that generation's client only.
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
class NodeLoadJob:
    """Node-tier pages of ``hashes`` straight into one request's L1
    ``block_ids`` (by position), with no host page of this instance's L2
    (l3/node_loads.py). ``in_step``: loaded before this step's forward, as
    a layerwise L2 hit is (the request was admitted with a synchronous
    load); else async: the request waits until every rank finished. Either
    way the blocks after a rank's loaded prefix are load errors (recomputed)."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    in_step: bool = False

    def __post_init__(self) -> None:
        assert len(self.hashes) == len(self.block_ids), (len(self.hashes), len(self.block_ids))


@dataclass(frozen=True)
class SameStepLoad:
    """L3 pages read by prefetch ``op_id`` of this step into one request's
    L1 blocks (l3/same_step.py): ``copy`` pairs each block with the page
    the op's ``k``-th read fills, k in order from 0. Each rank copies the
    leading pages its read has verified within ``wait_s`` seconds; the
    blocks after them are load errors (recomputed)."""

    req_id: str
    op_id: int
    copy: BlockCopy
    wait_s: float
    generation: int = 0


@dataclass(frozen=True)
class PrefetchJob:
    """Read L3 objects of ``hashes`` into host ``pages`` (L3 -> L2)."""

    op_id: int
    hashes: tuple[bytes, ...]
    pages: tuple[int, ...]
    generation: int = 0


@dataclass(frozen=True)
class BackupJob:
    """Write host ``pages`` to L3 under ``hashes`` (L2 -> L3), after this
    step's stores have filled them. ``states``: per page, whether its state
    part is valid (models with a state group, page_states.py; else empty)."""

    op_id: int
    hashes: tuple[bytes, ...]
    pages: tuple[int, ...]
    states: tuple[bool, ...] = ()
    generation: int = 0


class PrefetchProgress(NamedTuple):
    """One rank's progress on one prefetch op."""

    done: int           # leading pages verified and written into L2
    finished: bool      # nothing more will come
    # Of those, the pages (indices into the job's pages) whose state part is
    # valid (models with a state group; else empty).
    state_pages: frozenset[int] = frozenset()


class PrefetchTiming(NamedTuple):
    """Where one rank's time on one prefetch op went, in seconds of that
    rank's own clock: durations only, since monotonic clocks of different
    processes do not compare (the scheduler places them in its own timeline,
    l3/hit_stages.py)."""

    queue_s: float      # handed to the L3 pool -> its read started (prior copies included)
    io_s: float         # the backend's reads and the copies into the pool
    check_s: float      # opening sealed objects: check and decryption


@dataclass(frozen=True)
class StorageCommand:
    """Prepare, commit or abort a new L3 client on this rank, or detach it
    (admin API; admin/storage_control.py, l3/attach_worker.py). Run first,
    before any other operation of its step; acknowledged in
    ``HiCacheWorkerMetadata.storage_acks``. ``storage_keys``: the
    ``hicache_storage_*`` keys, as kv_connector_extra_config holds them, that
    each worker parses as it does at start (may hold a secret: never shown)."""

    cmd_id: int
    action: str  # "prepare" | "commit" | "abort" | "detach"
    storage_keys: dict | None = field(default=None, repr=False)
    # prepare: two free host pages the start canary may use (l3_canary).
    canary_pages: tuple[int, int] | None = None
    # The backend generation the command builds, switches to or drops.
    generation: int = 0
    # commit, detach: what becomes of the old client's unwritten backups
    # ("finish" | "drop" | "move"; policy/storage_switch.py).
    pending_backups: str = "finish"


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
