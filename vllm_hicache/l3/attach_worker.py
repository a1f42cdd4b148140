"""The worker side of a runtime attach or detach (admin/storage_control.py): each rank
builds or closes its L3 client (``HiCacheWorker._io``) when a step's
metadata carries a ``StorageCommand``, before anything else of the step,
and acknowledges with its error or "" in its worker metadata.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from vllm_hicache.admin.storage_control import _shown_error
from vllm_hicache.connector.metadata import StorageCommand
from vllm_hicache.storage_config import parse_storage

if TYPE_CHECKING:
    from vllm_hicache.connector.worker import HiCacheWorker

logger = logging.getLogger(__name__)


def run_storage_command(worker: HiCacheWorker, cmd: StorageCommand) -> dict[int, dict[int, str]]:
    """Attach or detach this rank's L3 client (``HiCacheWorker._io``);
    the ack for ``worker_meta``: {cmd_id: {worker rank: error or ""}}
    (l3_setup.worker_rank: unique over PP x TP)."""
    from vllm_hicache.l3.setup import worker_rank

    rank = worker_rank(worker._vllm_config)
    try:
        if cmd.action == "detach":
            _detach_worker(worker)
        else:
            _attach_worker(worker, cmd)
        error = ""
    except Exception as err:  # noqa: BLE001 - reported, then rolled back
        error = _shown_error(err)
        logger.warning("HiCache L3: %s on rank %d failed: %s", cmd.action, rank, error)
    return {cmd.cmd_id: {rank: error}}


def _attach_worker(worker: HiCacheWorker, cmd: StorageCommand) -> None:
    from vllm_hicache.l3.canary import DisabledPageStore
    from vllm_hicache.l3.setup import build_storage_io

    if worker.pool is None:
        raise RuntimeError("KV caches are not registered yet")
    if worker._io is not None:  # never planned: the scheduler attaches only when detached
        _detach_worker(worker)
    cfg = dataclasses.replace(worker.cfg, storage=parse_storage(cmd.storage_keys or {}))
    io = build_storage_io(cfg, worker.geom, worker._vllm_config, worker.pool, cmd.canary_pages)
    if isinstance(io.pages, DisabledPageStore):
        io.shutdown()
        raise RuntimeError(io.pages.reason)
    worker._io = io
    worker.cfg = cfg


def _detach_worker(worker: HiCacheWorker) -> None:
    io, worker._io = worker._io, None
    worker.cfg = dataclasses.replace(worker.cfg, storage=None)
    if io is not None:
        io.shutdown()
