"""Worker half: owns the host pool and executes the scheduler's operations.

One instance per TP rank. It never decides policy: page numbers come from the
scheduler half, identical on every rank (each rank stores its own heads).

Ordering (see connector/metadata.py): write-back copies run in
``handle_preemptions`` before the forward; sync loads run layer by layer in
``wait_for_layer_load`` (CPU) or are queued on a transfer stream in
``start_load_kv`` with one event per layer (CUDA); stores run in
``wait_for_save`` after the forward. On CUDA every copy uses one transfer
stream, so stores of step N precede loads of step N+1, and the compute stream
waits for the stores before a step can overwrite a stored block.

Failure invariant (same on CPU and CUDA): a copy that raises never kills the
worker. A failed load becomes load errors for exactly its job's blocks (vLLM
recomputes them); a layerwise job that failed on one layer is not copied on
later layers, but every layer's event is still recorded, and that step's
stores are dropped like failed ones (the forward computed on top of missing
KV). A failed store
leaves garbage in its host pages: they are reported to the scheduler
(``failed_store_pages``) so it drops them from the index, and until a later
store or prefetch rewrites them no load or L3 backup on this rank reads them
(the scheduler may already have planned some before it hears of the failure).
"""

from __future__ import annotations

import logging
import time

import torch

from vllm_hicache.config import HiCacheConfig, resolve_conflicts
from vllm_hicache.connector.async_loads import AsyncLoader
from vllm_hicache.connector.geometry import KVGeometry, host_num_pages
from vllm_hicache.connector.l3_attach import run_storage_command
from vllm_hicache.connector.l3_setup import build_storage_io
from vllm_hicache.connector.l3_worker import StorageIO
from vllm_hicache.connector.metadata import (
    BackupJob,
    BlockCopy,
    HiCacheMetadata,
    HiCacheWorkerMetadata,
    LoadJob,
)
from vllm_hicache.connector.stats import CopyClock, WorkerCounters, key, l3_usage_gauges
from vllm_hicache.host import HostKVPool
from vllm_hicache.kernels import describe_kv_tensor, make_transfer

logger = logging.getLogger(__name__)


class HiCacheWorker:
    def __init__(self, cfg: HiCacheConfig, geom: KVGeometry, vllm_config) -> None:
        self.cfg = cfg
        self.geom = geom
        self.num_pages = host_num_pages(cfg, geom)
        self._vllm_config = vllm_config
        self.pool: HostKVPool | None = None
        self.transfer = None
        # L1 tensors in layer order (what the transfer reads and writes).
        self.transfer_tensors: list[torch.Tensor] = []
        self._layer_index = {name: i for i, name in enumerate(geom.layer_names)}
        self._meta: HiCacheMetadata | None = None
        self._pending_layers: set[int] = set()
        self._load_errors: set[int] = set()
        # Layerwise jobs of this step that failed: skipped on later layers.
        self._failed_loads: set[str] = set()
        # Pages whose latest L1 -> L2 store raised: garbage until rewritten.
        self._garbage_pages: set[int] = set()
        # Failed-store pages not yet reported to the scheduler.
        self._failed_store_pages: set[int] = set()
        self._stream = None
        self._layer_events: dict[int, object] = {}
        self._store_done = None
        self._async: AsyncLoader | None = None
        self._evicted_for: HiCacheMetadata | None = None
        self._io: StorageIO | None = None
        # Acks of admin attach/detach commands (l3_attach.py) not yet reported.
        self._storage_acks: dict[int, dict[int, str]] = {}
        # Metrics (stats.py): bytes and seconds of this rank's copies.
        self.counters = WorkerCounters()
        self.clock = CopyClock(self.counters)
        self._l3_gauges_at = 0.0
        # Backup op -> hashes this rank dropped (garbage pages), not yet reported.
        self._backup_failures: dict[int, set[bytes]] = {}

    # --- set-up ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.geom.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"HiCache: KV caches missing for layers {missing}")
        tensors = [kv_caches[n] for n in self.geom.layer_names]
        self.transfer_tensors = tensors
        device = tensors[0].device
        cfg = self.cfg  # resolved for this platform by the connector
        layouts = [
            describe_kv_tensor(
                t,
                num_blocks=self.geom.num_l1_blocks,
                block_size=self.geom.block_size,
                num_kv_heads=self.geom.num_kv_heads,
                head_size=self.geom.head_size,
                is_mla=self.geom.is_mla,
                backend_name=self._backend_name(name),
            )
            for name, t in zip(self.geom.layer_names, tensors)
        ]
        self.pool = HostKVPool.for_layouts(
            self.num_pages, layouts, cfg.hicache_mem_layout,
            pin_memory=device.type == "cuda",
        )
        if cfg.hicache_io_backend == "kernel" and not self.pool.is_pinned:
            cfg = self._without_pinning(cfg)
        self.transfer = make_transfer(cfg.hicache_io_backend, tensors, layouts, self.pool)
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)
        self._async = AsyncLoader(self.transfer, self._stream, self.clock,
                                  self.pool.bytes_per_page)
        if cfg.storage is not None:
            self._io = build_storage_io(cfg, self.geom, self._vllm_config, self.pool)
        # The engine's one INFO line is the scheduler half's (connector.start_line).
        logger.debug(
            "HiCache worker: %d host pages (%.2f GB), layout=%s, io=%s, device=%s",
            self.num_pages, self.pool.num_bytes / 1e9, cfg.hicache_mem_layout,
            cfg.hicache_io_backend, device,
        )

    @staticmethod
    def _without_pinning(cfg: HiCacheConfig) -> HiCacheConfig:
        """Kernel copies need the pool pinned, and pinning it failed. The
        layout is fixed by now (the pool exists, L3 keys name it), so only a
        fallback that keeps it is taken."""
        resolved = resolve_conflicts(cfg, "a pinned host pool (cudaHostRegister failed)")
        if resolved.hicache_mem_layout != cfg.hicache_mem_layout:
            raise ValueError(
                f"hicache_io_backend=kernel with hicache_mem_layout={cfg.hicache_mem_layout} "
                "needs a pinned host pool and cudaHostRegister failed (check the memlock "
                "limit); set hicache_mem_layout=page_first_direct or layer_first to allow "
                "direct copies")
        return resolved

    def _backend_name(self, layer_name: str) -> str:
        ctx = self._vllm_config.compilation_config.static_forward_context
        layer = ctx.get(layer_name)
        backend = getattr(layer, "attn_backend", None)
        return backend.get_name() if backend is not None else "UNKNOWN"

    # --- per step ----------------------------------------------------------

    def handle_preemptions(self, meta: HiCacheMetadata) -> None:
        """Runs before the step's forward can overwrite any block."""
        self._wait_stores_on_compute()
        if meta.evict_stores and self._evicted_for is not meta:
            # Write-back: these blocks were just handed to new requests. Their
            # KV may come from a forward still in flight, hence after_compute.
            self._store(meta.evict_stores, "write-back")
            # Even after a failure: part of the copy may still be queued.
            self._wait_stores_on_compute(record_now=True)
        self._evicted_for = meta

    def bind(self, meta: HiCacheMetadata) -> None:
        if self._evicted_for is not meta:
            # A runner that skips handle_preemptions: still copy first.
            self.handle_preemptions(meta)
        self._meta = meta
        if meta.storage_command is not None:  # before any L3 job of this step
            self._storage_acks.update(run_storage_command(self, meta.storage_command))
        if meta.prefetches:
            # Prefetch pages may have fed a load a moment ago (CUDA: still
            # queued): the reads start after everything issued so far.
            ready = self._record_event() if self._stream is not None else None
            for job in meta.prefetches:
                # The read rewrites these pages; the scheduler indexes only
                # what it reports as read, so old garbage no longer matters.
                self._garbage_pages.difference_update(job.pages)
                self._io.submit_prefetch(job, ready)
        self._pending_layers = set(range(self.geom.num_layers)) if meta.loads else set()
        self._layer_events = {}
        self._failed_loads = set()
        for job in meta.loads:
            if self._reads_garbage(job):
                self._fail_load(job)

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        for job in meta.async_loads:
            if self._reads_garbage(job):
                self._async.fail(job)
            else:
                self._async.submit(job)
        if meta.loads and self._stream is not None:
            self._queue_layer_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or layer not in self._pending_layers:
            return
        self._pending_layers.discard(layer)
        if self._stream is not None:
            torch.cuda.current_stream().wait_event(self._layer_events[layer])
            return
        self._load_layer(layer)

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        if self._pending_layers:
            # The forward skipped a layer hook: its KV was used unloaded.
            # Load now for the cache's sake, and make vLLM recompute.
            logger.warning("HiCache: layers %s were not loaded in time", sorted(self._pending_layers))
            for layer in sorted(self._pending_layers):
                self._load_layer(layer)
            for job in meta.loads:
                self._fail_load(job)
            self._pending_layers.clear()
        if meta.stores and self._failed_loads:
            # This forward attended to KV that never arrived: what it computed
            # on top of it is wrong too. Which stored blocks depend on the
            # failed requests is unknown here, so none of this step's stores
            # may become L2 (or L3) content.
            logger.warning("HiCache: a load failed this step; its %d stores are dropped",
                           len(meta.stores))
            self._mark_failed_stores(meta.stores)
        elif meta.stores:
            self._store(meta.stores, "store")
            if self._stream is not None:
                self._store_done = self._record_event()
        if meta.backups:
            ready = self._record_event() if self._stream is not None else None
            for job in meta.backups:
                self._io.submit_backup(self._without_garbage(job), ready)

    def _load_layer(self, layer: int) -> None:
        started = self.clock.start()
        for job in self._meta.loads:
            self._copy_layer(layer, job)
        self.clock.stop(started, "load", self._loaded_blocks(self._meta)
                        * (self.pool.bytes_per_page // self.geom.num_layers))

    def _loaded_blocks(self, meta: HiCacheMetadata) -> int:
        return sum(len(j.copy) for j in meta.loads if j.req_id not in self._failed_loads)

    def _queue_layer_loads(self, meta: HiCacheMetadata) -> None:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            started = self.clock.start(self._stream)
            for layer in range(self.geom.num_layers):
                for job in meta.loads:
                    self._copy_layer(layer, job)
                # Recorded whatever failed: wait_for_layer_load needs every event.
                self._layer_events[layer] = self._record_event()
            self.clock.stop(started, "load", self._loaded_blocks(meta) * self.pool.bytes_per_page,
                            self._stream)

    def _copy_layer(self, layer: int, job: LoadJob) -> None:
        if job.req_id in self._failed_loads:
            return  # its blocks are recomputed: more copies are wasted work
        try:
            self.transfer.load_layer(layer, job.copy.block_ids, job.copy.page_ids)
        except Exception:  # a failed copy must become a recompute, not a crash
            logger.exception("HiCache: layer %d load of %s failed", layer, job.req_id)
            self._fail_load(job)

    def _fail_load(self, job: LoadJob) -> None:
        self._failed_loads.add(job.req_id)
        self._load_errors.update(job.copy.block_ids)

    def _store(self, copy: BlockCopy, what: str) -> None:
        try:
            self._run_on_stream(self.transfer.store, copy, after_compute=True)
        except Exception:  # a failed store costs cache, never the worker
            logger.exception(
                "HiCache: %s of %d blocks to host failed; their pages are dropped", what, len(copy)
            )
            # Which pages the copy reached before raising is unknown: all suspect.
            self._mark_failed_stores(copy)
            return
        self._garbage_pages.difference_update(copy.page_ids)

    def _mark_failed_stores(self, copy: BlockCopy) -> None:
        self._garbage_pages.update(copy.page_ids)
        self._failed_store_pages.update(copy.page_ids)

    def _reads_garbage(self, job: LoadJob) -> bool:
        if self._garbage_pages.isdisjoint(job.copy.page_ids):
            return False
        logger.warning("HiCache: load of %s reads pages whose store failed; recomputing", job.req_id)
        return True

    def _without_garbage(self, job: BackupJob) -> BackupJob:
        """The backup minus pages whose store failed: an L3 object made from
        garbage would carry a valid checksum and poison every instance."""
        if self._garbage_pages.isdisjoint(job.pages):
            return job
        keep = [i for i, page in enumerate(job.pages) if page not in self._garbage_pages]
        # Not written: no L3 event may announce them (kv_events.py).
        self._backup_failures.setdefault(job.op_id, set()).update(
            h for h, page in zip(job.hashes, job.pages) if page in self._garbage_pages)
        return BackupJob(
            job.op_id, tuple(job.hashes[i] for i in keep), tuple(job.pages[i] for i in keep)
        )

    # --- streams (CUDA only; no-ops on CPU) --------------------------------

    def _run_on_stream(self, fn, copy: BlockCopy, after_compute: bool = False,
                       op: str = "store") -> None:
        num_bytes = len(copy) * self.pool.bytes_per_page
        if self._stream is None:
            started = self.clock.start()
            fn(copy.block_ids, copy.page_ids)
            self.clock.stop(started, op, num_bytes)
            return
        if after_compute:
            self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            started = self.clock.start(self._stream)
            fn(copy.block_ids, copy.page_ids)
            self.clock.stop(started, op, num_bytes, self._stream)

    def _record_event(self):
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _wait_stores_on_compute(self, record_now: bool = False) -> None:
        if self._stream is None:
            return
        if record_now:
            self._store_done = self._record_event()
        if self._store_done is not None:
            torch.cuda.current_stream().wait_event(self._store_done)

    # --- completions -------------------------------------------------------

    def clear(self) -> None:
        self._meta = None

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self._async is None:
            return None, None
        done, failed_blocks = self._async.poll()
        self._load_errors.update(failed_blocks)
        return None, (done or None)

    def worker_meta(self) -> HiCacheWorkerMetadata | None:
        # Failed stores are reported with or without L3: the L2 index needs them.
        failed_pages, self._failed_store_pages = self._failed_store_pages, set()
        progress, backups = self._io.poll() if self._io is not None else ({}, set())
        storage_acks, self._storage_acks = self._storage_acks, {}
        backup_failures, self._backup_failures = self._backup_failures, {}
        if self._io is not None:
            for op_id, hashes in self._io.take_backup_failures().items():
                backup_failures.setdefault(op_id, set()).update(hashes)
        if (not progress and not backups and not failed_pages and not storage_acks
                and not backup_failures):
            return None
        rank = self._io.tp_rank if self._io is not None else None
        return HiCacheWorkerMetadata(
            prefetch={op: {rank: p} for op, p in progress.items()},
            backups={op: {rank} for op in backups},
            failed_store_pages=failed_pages,
            storage_acks=storage_acks,
            backup_failures=backup_failures,
        )

    def stats(self) -> tuple[dict[str, float], dict[str, float]]:
        """Counter increments since the last call, and gauges (L3 usage,
        sampled at most once a second), for get_kv_connector_stats."""
        self.clock.collect()
        counts = self.counters.take()
        gauges: dict[str, float] = {}
        io = self._io
        if io is not None:
            if io.counters is not self.counters:  # an L3 client built elsewhere (attach)
                for k, v in io.counters.take().items():
                    counts[k] = counts.get(k, 0) + v
            invalid = io.take_invalid_objects()
            if invalid:
                counts[key("l3_errors", "invalid_object")] = invalid
            now = time.monotonic()
            if io.tp_rank == 0 and now - self._l3_gauges_at >= 1.0:
                self._l3_gauges_at = now
                gauges = l3_usage_gauges(io.pages.backend)
        return counts, gauges

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._async is not None:
            self._async.shutdown()
        if self._io is not None:
            self._io.shutdown()
        if self.transfer is not None:
            self.transfer.synchronize()
        if self.pool is not None:
            self.pool.close()
        self.pool = None
        self.transfer = None
