"""The envelopes vLLM carries between the two halves of the connector.

Scheduler -> workers, once per step: ``HiCacheMetadata``. Its operations are
executed by every worker in this order, and step N's operations finish before
step N+1's start (stores of step N before loads of step N+1):

1. ``evict_stores``: write-back copies L1 -> L2 of blocks vLLM is handing to
   new requests this step; run before the forward overwrites them.
2. ``loads``: L2 -> L1 for requests scheduled this step (layer by layer in
   layerwise mode, overlapped with the forward).
3. ``async_loads``: L2 -> L1 for requests waiting in WAITING_FOR_REMOTE_KVS;
   completion is reported through ``get_finished``; ``node_loads`` likewise,
   from the node tier's shared segment straight into L1, except those marked
   ``in_step``, which are loaded before the forward, as ``loads`` are.
4. ``stores``: write-through copies L1 -> L2 of blocks completed by this
   step's forward; run after the forward.

``prefetch_wait_s``: how long each worker may wait, before its report, for
its open prefetches to finish (l3/report_wait.py); 0: not at all.
``stop_flush``: a graceful stop's flush time is running: the workers' backups
leave the background (scheduler/graceful_stop.py, l3/worker_io.py).

Everything here must pickle: it crosses from EngineCore to the workers. The
jobs inside are ``common/jobs.py``'s, which the workers execute as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_hicache.common.jobs import (
    BackupJob,
    BlockCopy,
    LoadJob,
    NodeLoadJob,
    PrefetchJob,
    PrefetchProgress,
    PrefetchTiming,
    SameStepLoad,
    StorageCommand,
)
from vllm_hicache.common.node_counts import NodeTierCounts, merge_reports


@dataclass
class HiCacheMetadata(KVConnectorMetadata):
    evict_stores: BlockCopy = field(default_factory=BlockCopy)
    loads: list[LoadJob] = field(default_factory=list)
    async_loads: list[LoadJob] = field(default_factory=list)
    stores: BlockCopy = field(default_factory=BlockCopy)
    prefetches: list[PrefetchJob] = field(default_factory=list)
    backups: list[BackupJob] = field(default_factory=list)
    storage_command: StorageCommand | None = None
    prefetch_wait_s: float = 0.0
    # Loads from the node tier into L1, no L2 page (common/jobs.py).
    node_loads: list[NodeLoadJob] = field(default_factory=list)
    # L3 hits admitted in the step their read is sent: L1 copies that wait
    # (bounded) for this step's prefetch reads (l3/same_step.py).
    same_step_loads: list[SameStepLoad] = field(default_factory=list)
    stop_flush: bool = False


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
    (reported no later than that rank's ack; for KV events).
    ``l3_removed_keys``: keys of L3 objects some rank's client removed
    (``max_bytes`` eviction) since its last report (exact KV events,
    l3/removals.py).
    ``prefetch_timing``: op -> rank -> PrefetchTiming, sent once, with (or
    after) the progress that finishes the op on that rank.
    ``node_tier_counts``: worker id -> its node tier page counts since it
    started (running totals, merged by the latest: common/node_counts.py),
    in every report once nonzero."""

    prefetch: dict[int, dict[int, PrefetchProgress]] = field(default_factory=dict)
    backups: dict[int, set[int]] = field(default_factory=dict)
    failed_store_pages: set[int] = field(default_factory=set)
    storage_acks: dict[int, dict[int, str]] = field(default_factory=dict)
    backup_failures: dict[int, set[bytes]] = field(default_factory=dict)
    l3_removed_keys: set[str] = field(default_factory=set)
    prefetch_timing: dict[int, dict[int, PrefetchTiming]] = field(default_factory=dict)
    node_tier_counts: dict[int, NodeTierCounts] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HiCacheWorkerMetadata:
        assert isinstance(other, HiCacheWorkerMetadata)
        for op_id, progress_by_rank in other.prefetch.items():
            self.prefetch.setdefault(op_id, {}).update(progress_by_rank)
        for op_id, ranks in other.backups.items():
            self.backups.setdefault(op_id, set()).update(ranks)
        self.failed_store_pages |= other.failed_store_pages
        for cmd_id, error_by_rank in other.storage_acks.items():
            self.storage_acks.setdefault(cmd_id, {}).update(error_by_rank)
        for op_id, hashes in other.backup_failures.items():
            self.backup_failures.setdefault(op_id, set()).update(hashes)
        self.l3_removed_keys |= other.l3_removed_keys
        for op_id, timing_by_rank in other.prefetch_timing.items():
            self.prefetch_timing.setdefault(op_id, {}).update(timing_by_rank)
        merge_reports(self.node_tier_counts, other.node_tier_counts)
        return self
