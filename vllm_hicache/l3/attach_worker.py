"""The worker side of a runtime attach or detach (admin/storage_control.py):
each rank builds or closes its L3 client when a step's metadata carries a
``StorageCommand``, before anything else of the step, and acknowledges with
its error or "" in its worker metadata.

The rank's client and the storage config it was built from are passed in
and the new pair comes back, so this module needs nothing of the worker
half above it. Whatever fails, the pair returned is what the rank holds:
an attach over an attached client detaches it first; a failed attach
leaves the rank detached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from vllm_hicache.common.jobs import StorageCommand
from vllm_hicache.l3.canary import DisabledPageStore
from vllm_hicache.l3.worker_io import StorageIO
from vllm_hicache.redaction import shown_error
from vllm_hicache.storage_config import StorageConfig, parse_storage

logger = logging.getLogger(__name__)

# Builds a rank's client for a storage config; ``canary_pages``: two free
# host pages the start canary may use (l3/canary.py).
BuildIO = Callable[[StorageConfig, "tuple[int, int] | None"], StorageIO]


class RankStorage(NamedTuple):
    """What one rank holds after a command."""

    io: StorageIO | None
    storage: StorageConfig | None
    # {cmd_id: {worker id: error or ""}} for the worker metadata
    # (l3/setup.worker_id: unique over PP x TP).
    ack: dict[int, dict[int, str]]


def run_storage_command(cmd: StorageCommand, io: StorageIO | None,
                        storage: StorageConfig | None, build: BuildIO,
                        worker_id: int) -> RankStorage:
    """Attach or detach this rank's L3 client (see module doc)."""
    try:
        if cmd.action == "detach" or io is not None:
            # An attach finds none: the scheduler attaches only when detached.
            old, io, storage = io, None, None
            if old is not None:
                old.shutdown()
        if cmd.action == "attach":
            new_storage = parse_storage(cmd.storage_keys or {})
            if new_storage is None:
                raise ValueError("attach command names no hicache_storage_* keys")
            new_io = build(new_storage, cmd.canary_pages)
            if isinstance(new_io.pages, DisabledPageStore):
                new_io.shutdown()
                raise RuntimeError(new_io.pages.reason)
            io, storage = new_io, new_storage
        error = ""
    except Exception as err:  # noqa: BLE001 - reported, then rolled back
        error = shown_error(err)
        logger.warning("HiCache L3: %s on worker %d failed: %s", cmd.action, worker_id, error)
    return RankStorage(io, storage, {cmd.cmd_id: {worker_id: error}})
