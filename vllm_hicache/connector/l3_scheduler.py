"""Scheduler half of the L3 tier: lookups, prefetch ops, backup ops.

Lookup: when a request arrives, the blocks beyond what L1/L2 hold are looked
up in L3 (``exists_prefix``, min over TP ranks) on a background thread, so
the scheduler never waits on I/O. Prefetch: in ``build_connector_meta`` a
finished lookup whose hit reaches ``prefetch_threshold`` gets host pages
(bounded by the in-flight cap) and becomes a PrefetchJob for the workers.
As every rank reports progress, the pages all ranks have verified are
inserted into the tree: from then on they are ordinary L2 hits. Backup:
pages stored to L2 in a step are written to L3 by the workers after the
store; a BACKUP op (page_ops.py) pins them until every rank has acknowledged.

Prefetch policies decide only whether a request *waits* for its lookup and
prefetch (``must_wait``): best_effort never, wait_complete until the
prefetch ends (but never past ``prefetch_timeout_max``: a stuck store must not
stall a request), timeout until it ends or its deadline passes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_hicache.connector.daemon_pool import DaemonPool
from vllm_hicache.connector.metadata import BackupJob, HiCacheWorkerMetadata, PrefetchJob
from vllm_hicache.connector.page_ops import OpKind, PageOp, PageOps, PinnedRange
from vllm_hicache.index import HiRadixTree
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage import StorageBackend
from vllm_hicache.storage_config import StorageConfig

logger = logging.getLogger(__name__)

# Lookups queued or running at once, at most (one lookup thread).
MAX_PENDING_LOOKUPS = 256


@dataclass(slots=True)
class _Op:
    op_id: int
    chain: tuple[bytes, ...]   # hashes of blocks 0 .. start + len(pages)
    start: int                 # first block the op fills
    pages: list[int]
    committed: int = 0
    progress: dict[int, tuple[int, bool]] = field(default_factory=dict)


@dataclass(slots=True)
class _Lookup:
    chain: tuple[bytes, ...]   # hashes of blocks 0 .. limit
    start: int
    deadline: float
    future: Future | None = None
    op: _Op | None = None
    done: bool = False         # nothing (more) to wait for


class StoragePlanner:
    def __init__(self, cfg: StorageConfig, backend: StorageBackend, namespaces: list[KeyNamespace],
                 block_size: int, world_size: int, max_inflight_pages: int) -> None:
        self.cfg = cfg
        self.backend = backend
        self.namespaces = namespaces
        self.block_size = block_size
        self.world_size = world_size
        self.max_inflight_pages = max_inflight_pages
        self.threshold_blocks = max(1, -(-cfg.prefetch_threshold // block_size))
        self._executor = DaemonPool(1, "hicache-l3-lookup")
        self._lookups: dict[str, _Lookup] = {}
        # Kept by the lookups' completion callbacks (the lookup thread), so a
        # new request or a step costs O(1), not a scan of every lookup.
        self._pending_lock = threading.Lock()
        self._num_pending_lookups = 0
        self._finished_lookups: collections.deque[tuple[str, _Lookup]] = collections.deque()
        self._ops: dict[int, _Op] = {}
        self._inflight_pages = 0
        self._backups: dict[int, PageOp] = {}
        self._backup_acks: dict[int, set[int]] = {}
        self._op_ids = itertools.count()
        self.prefetched_blocks = 0
        self.skipped_lookups = 0
        self.backed_up_blocks = 0

    # --- lookups -----------------------------------------------------------

    def start_lookup(self, req_id: str, chain: tuple[bytes, ...], start: int) -> None:
        """Look up blocks [start, len(chain)) of a new request in L3."""
        if len(chain) - start < self.threshold_blocks:
            return
        if self._num_pending_lookups >= MAX_PENDING_LOOKUPS:
            # A slow or dead store must not build an unbounded backlog: the
            # request simply gets no L3 hit.
            self.skipped_lookups += 1
            return
        tokens = (len(chain) - start) * self.block_size
        # wait_complete too is bounded (docs/design.md, invariant 3): by
        # prefetch_timeout_max.
        wait_s = (self.cfg.prefetch_timeout_s(tokens) if self.cfg.prefetch_policy == "timeout"
                  else self.cfg.prefetch_timeout_max)
        lookup = _Lookup(chain, start, time.monotonic() + wait_s)
        with self._pending_lock:
            self._num_pending_lookups += 1
        lookup.future = self._executor.submit(self._exists, chain[start:])
        self._lookups[req_id] = lookup
        lookup.future.add_done_callback(lambda _: self._lookup_done(req_id, lookup))

    def _lookup_done(self, req_id: str, lookup: _Lookup) -> None:
        """Completion callback (lookup thread, or here if already done)."""
        with self._pending_lock:
            self._num_pending_lookups -= 1
        self._finished_lookups.append((req_id, lookup))

    def _exists(self, hashes: tuple[bytes, ...]) -> int:
        hit = len(hashes)
        for ns in self.namespaces:
            hit = min(hit, self.backend.exists_prefix(ns.object_keys(hashes[:hit])))
            if hit == 0:
                break
        return hit

    def must_wait(self, req_id: str) -> bool:
        """Should this request wait (``None`` from get_num_new_matched_tokens)?"""
        lookup = self._lookups.get(req_id)
        if lookup is None or self.cfg.prefetch_policy == "best_effort" or lookup.done:
            return False
        if lookup.op is None and lookup.future.done() and self._hit(lookup) < self.threshold_blocks:
            lookup.done = True  # a miss: nothing to wait for (idempotent)
            return False
        return time.monotonic() <= lookup.deadline

    @staticmethod
    def _hit(lookup: _Lookup) -> int:
        try:
            return lookup.future.result()
        except Exception as exc:  # noqa: BLE001 - a failed lookup is a miss
            # One line, no traceback: a dead store fails every lookup.
            logger.warning("HiCache L3 lookup failed, counted as a miss: %r", exc)
            return 0

    def forget(self, req_id: str) -> None:
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None:
            lookup.future.cancel()  # no-op if it already runs

    # --- per step ------------------------------------------------------------

    def plan_prefetches(self, tree: HiRadixTree, alloc) -> list[PrefetchJob]:
        """Prefetch ops for the lookups that finished since the last step
        (each is considered once, as it finishes)."""
        jobs = []
        while self._finished_lookups:
            req_id, lookup = self._finished_lookups.popleft()
            if self._lookups.get(req_id) is not lookup:
                continue  # its request is gone
            if lookup.op is None and not lookup.done:
                job = self._start_op(lookup, tree, alloc)
                if job is not None:
                    jobs.append(job)
        return jobs

    def _start_op(self, lookup: _Lookup, tree: HiRadixTree, alloc) -> PrefetchJob | None:
        lookup.done = True  # unless an op starts below
        end = lookup.start + self._hit(lookup)
        matched = tree.match(lookup.chain[:end]).pages
        start = lookup.start
        while start < len(matched) and matched[start] is not None:
            start += 1  # arrived in L2 meanwhile
        room = self.max_inflight_pages - self._inflight_pages
        num = min(end - start, room)
        if num < self.threshold_blocks:
            return None
        pages = alloc(lookup.chain, len(matched), num)
        if pages is None:
            return None
        op = _Op(next(self._op_ids), lookup.chain[: start + num], start, pages)
        self._ops[op.op_id] = op
        self._inflight_pages += num
        lookup.op, lookup.done = op, False
        return PrefetchJob(op.op_id, op.chain[start:], tuple(pages))

    def plan_backup(self, ops: PageOps, stored: list[PinnedRange], step: int) -> list[BackupJob]:
        """One backup op for this step's stored pages (their STORE ops pin
        them now; the BACKUP op keeps them pinned until every rank acked)."""
        if not stored:
            return []
        op = ops.open(OpKind.BACKUP, step, stored)
        hashes = tuple(r.chain[i] for r in stored for i in r.blocks)
        pages = tuple(p for r in stored for p in r.pages)
        self._backups[op.op_id] = op
        self.backed_up_blocks += len(pages)
        return [BackupJob(op.op_id, hashes, pages)]

    def has_open_prefetches(self) -> bool:
        return bool(self._ops)

    def prefetch_pages(self) -> set[int]:
        """Pages open prefetches hold outside the tree (not yet committed)."""
        return {p for op in self._ops.values() for p in op.pages[op.committed:]}

    # --- completions -------------------------------------------------------

    def on_worker_meta(self, meta: HiCacheWorkerMetadata, tree: HiRadixTree,
                       ops: PageOps) -> None:
        for op_id, by_rank in meta.prefetch.items():
            op = self._ops.get(op_id)
            if op is not None:
                for rank, (done, finished) in by_rank.items():
                    # Never backwards: a rank's count and end only grow.
                    prev_done, prev_finished = op.progress.get(rank, (0, False))
                    op.progress[rank] = (max(done, prev_done), finished or prev_finished)
                self._advance(op, tree)
        for op_id, ranks in meta.backups.items():
            self._ack_backup(op_id, ranks, ops)

    def _advance(self, op: _Op, tree: HiRadixTree) -> None:
        if len(op.progress) < self.world_size:
            return
        done = min(count for count, _ in op.progress.values())
        if done > op.committed:
            new = [None] * (op.start + op.committed) + op.pages[op.committed : done]
            unused = tree.insert(op.chain[: op.start + done], new)
            if unused:
                tree.free(unused)  # the tree got those blocks another way
            self.prefetched_blocks += done - op.committed
            op.committed = done
        if all(finished for _, finished in op.progress.values()):
            leftover = op.pages[op.committed :]
            if leftover:
                tree.free(leftover)
            self._inflight_pages -= len(op.pages)
            del self._ops[op.op_id]
            for lookup in self._lookups.values():
                if lookup.op is op:
                    lookup.done = True

    def _ack_backup(self, op_id: int, ranks: set[int], ops: PageOps) -> None:
        if op_id not in self._backups:
            return  # a duplicate or late ack of a finished backup
        acked = self._backup_acks.setdefault(op_id, set())
        acked |= ranks
        if len(acked) >= self.world_size:
            del self._backup_acks[op_id]
            ops.close(self._backups.pop(op_id))

    def clear_storage(self) -> None:
        """Admin: remove every object from L3 (reset_cache leaves L3 alone)."""
        self.backend.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
