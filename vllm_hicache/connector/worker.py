"""Worker half: owns the host pool and executes the scheduler's operations.

One instance per TP rank. It never decides policy: page numbers come from the
scheduler half, identical on every rank (each rank stores its own heads).

The data movement itself (host pool, copy engine, transfer stream and
per-layer events, async loads, stores, write-back copies, and what a failed
copy becomes) is ``datapath.KVDataPath``, which imports no vLLM. This class
maps vLLM's hooks onto its calls, handing it ``HiCacheMetadata``'s jobs
(``common/jobs.py``) as they are, and wires the L3 client (``StorageIO``) and the admin
attach/detach commands around it:

    handle_preemptions   -> before_forward(write-back copies)
    bind                 -> storage command, L3 prefetches, begin_step(loads and
                            the same-step loads read in time: l3/same_step.py)
    start_load_kv        -> start_loads(async loads); node-tier loads start
                            (l3/node_load_queue.py)
    wait_for_layer_load  -> wait_layer(layer index), after that layer's
                            node-tier copies
    wait_for_save        -> node-tier loads finish, then after_forward(stores),
                            then L3 backups
    clear                -> end_step()

Before each report (``worker_meta``) it waits, bounded by the step's
``prefetch_wait_s``, for its open prefetches (the scheduler half gives a step
a budget only while a request waits on one: l3/report_wait.py).

The ordering and failure invariants are stated in ``datapath/pipeline.py``.
L3 threads order themselves after the copies with ``ready_event``; a backup
never writes a page whose store failed (``unreadable``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from vllm_hicache import io_threads
from vllm_hicache.common.jobs import NO_COPY, BackupJob, StorageCommand
from vllm_hicache.common.node_counts import ZERO, NodeCountTally, NodeTierCounts
from vllm_hicache.common.stats import WorkerCounters, key, l3_usage_gauges
from vllm_hicache.config import HiCacheConfig, resolve_conflicts
from vllm_hicache.connector.geometry import KVGeometry, host_num_pages
from vllm_hicache.connector.metadata import HiCacheMetadata, HiCacheWorkerMetadata
from vllm_hicache.connector.vllm_compat import cpu_compute_cores
from vllm_hicache.datapath import KVDataPath, allocate_pool
from vllm_hicache.datapath.clock import CopyClock
from vllm_hicache.datapath.grouped import block_view
from vllm_hicache.host import HostKVPool
from vllm_hicache.kernels import describe_kv_tensor
from vllm_hicache.kernels.io_backends import IOBackend
from vllm_hicache.l3.attach_worker import RankL3
from vllm_hicache.l3.node_load_queue import L1Target, WorkerNodeLoads
from vllm_hicache.l3.same_step import StreamedLoads, split_loads
from vllm_hicache.l3.setup import build_storage_io, worker_id
from vllm_hicache.l3.worker_io import StorageIO
from vllm_hicache.storage_config import StorageConfig

logger = logging.getLogger(__name__)


class HiCacheWorker:
    def __init__(self, cfg: HiCacheConfig, geom: KVGeometry, vllm_config) -> None:
        self.cfg = cfg
        self.geom = geom
        self.num_pages = host_num_pages(cfg, geom)
        self._vllm_config = vllm_config
        # Before any of our threads starts: I/O off the compute cores (io_threads.py).
        io_threads.configure(io_threads.cores_off_compute(
            io_threads.parent_cpus(), cpu_compute_cores(vllm_config)))
        # Built by register_kv_caches.
        self.data: KVDataPath | None = None
        # L1 tensors in layer order (what the transfer reads and writes).
        self.transfer_tensors: list[torch.Tensor] = []
        self._layer_index = {name: i for i, name in enumerate(geom.layer_names)}
        self._meta: HiCacheMetadata | None = None
        self._evicted_for: HiCacheMetadata | None = None
        # This rank's L3 clients: the serving one, and those an admin
        # replace or detach staged or retired (l3/attach_worker.py).
        # (Its worker id is known once the ranks are: register_kv_caches.)
        self._rank_l3 = RankL3(None, cfg.storage, 0)
        # Metrics (stats.py): bytes and seconds of this rank's copies.
        self.counters = WorkerCounters()
        self.clock = CopyClock(self.counters)
        self._l3_gauges_at = 0.0
        # The node tier's page counts: one tally for the metrics and the
        # reports (common/node_counts.py).
        self._node_counts = NodeCountTally()
        # Backup op -> hashes this rank dropped (garbage pages), not yet reported.
        self._backup_failures: dict[int, set[bytes]] = {}
        # Hybrid models (several KV cache groups): copies name group block ids
        # (geometry.group_block_id); load failures are reported per request.
        self._hybrid = geom.num_groups > 1
        self._async_blocks: dict[str, frozenset[int]] = {}
        self._failed_recving: set[str] = set()
        # Node-tier hits loaded into L1 directly (l3/node_load_queue.py).
        self._node = WorkerNodeLoads(self._hybrid)
        # This step's same-step loads, copied as their reads deliver each
        # layer (CPU; l3/same_step.py); None when the step has none.
        self._streamed: StreamedLoads | None = None

    @property
    def pool(self) -> HostKVPool | None:
        return self.data.pool if self.data is not None else None

    @property
    def transfer(self):
        return self.data.transfer if self.data is not None else None

    @transfer.setter
    def transfer(self, transfer) -> None:
        self._path().transfer = transfer

    def _path(self) -> KVDataPath:
        """The data path: vLLM registers the KV caches before any step's hook."""
        if self.data is None:
            raise RuntimeError("KV caches are not registered yet")
        return self.data

    @property
    def _io(self) -> StorageIO | None:
        """This rank's serving L3 client, None while no backend is attached."""
        return self._rank_l3.io

    # --- set-up ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.geom.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"HiCache: KV caches missing for layers {missing}")
        tensors = self._state_layers_as_pages(
            [kv_caches[n] for n in self.geom.layer_names])
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
            for name, t in zip(self._layout_names(), tensors)
        ]
        pool = allocate_pool(self.num_pages, layouts, cfg.hicache_mem_layout, device)
        if cfg.hicache_io_backend == IOBackend.KERNEL and not pool.is_pinned:
            cfg = self._without_pinning(cfg)
        self.data = KVDataPath.build(
            tensors, layouts, pool, cfg.hicache_io_backend, clock=self.clock,
            group_layers=[g.layers for g in self.geom.groups],
            num_l1_blocks=self.geom.num_l1_blocks)
        self._rank_l3.worker_id = worker_id(self._vllm_config)
        if cfg.storage is not None:
            self._rank_l3.io = build_storage_io(cfg, self.geom, self._vllm_config, pool)
        # For the L3 client's node-tier loader now, and those of clients an
        # admin attach brings later.
        self._node.bind(L1Target(tensors, layouts, cfg.hicache_io_backend), self._l3_pages())
        # The engine's one INFO line is the scheduler half's (connector.start_line).
        logger.debug(
            "HiCache worker: %d host pages (%.2f GB), layout=%s, io=%s, device=%s",
            self.num_pages, pool.num_bytes / 1e9, cfg.hicache_mem_layout,
            cfg.hicache_io_backend, device,
        )

    def _attention_layer(self) -> int:
        """Index of the first attention layer (the page layout's model)."""
        mamba = {i for g in self.geom.mamba_groups for i in self.geom.groups[g].layers}
        return next(i for i in range(self.geom.num_layers) if i not in mamba)

    def _state_layers_as_pages(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Mamba groups' raw state tensors, viewed as attention-shaped pages
        (``datapath.block_view``: byte-exact, padding included)."""
        if not self.geom.mamba_groups:
            return tensors
        like = tensors[self._attention_layer()]
        out = list(tensors)
        for g in self.geom.mamba_groups:
            for i in self.geom.groups[g].layers:
                try:
                    out[i] = block_view(tensors[i], like)
                except ValueError as exc:
                    raise ValueError(f"HiCache: Mamba state layer {self.geom.layer_names[i]}: "
                                     f"{exc}") from exc
        return out

    def _layout_names(self) -> list[str]:
        """Per layer, the layer whose attention backend describes its layout
        (a Mamba layer is viewed as the first attention layer's layout)."""
        names = list(self.geom.layer_names)
        if self.geom.mamba_groups:
            like = names[self._attention_layer()]
            for g in self.geom.mamba_groups:
                for i in self.geom.groups[g].layers:
                    names[i] = like
        return names

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

    # --- per step: vLLM's hooks ----------------------------------------------

    def handle_preemptions(self, meta: HiCacheMetadata) -> None:
        """Runs before the step's forward can overwrite any block."""
        # Write-back: these blocks were just handed to new requests (once per step).
        write_back = meta.evict_stores if self._evicted_for is not meta else NO_COPY
        self._path().before_forward(write_back)
        self._evicted_for = meta

    def bind(self, meta: HiCacheMetadata) -> None:
        if self._evicted_for is not meta:
            # A runner that skips handle_preemptions: still copy first.
            self.handle_preemptions(meta)
        self._meta = meta
        if meta.storage_command is not None:  # before any L3 job of this step
            self._run_storage_command(meta.storage_command)
        # CPU: the same-step loads' copies follow their reads layer by layer.
        streamed = bool(meta.same_step_loads) and self._path().stream is None
        if meta.prefetches:
            # Prefetch pages may have fed a load a moment ago (CUDA: still
            # queued): the reads start after everything issued so far.
            data = self._path()
            ready = data.ready_event()
            same_step_ops = {load.op_id for load in meta.same_step_loads} if streamed else set()
            for job in meta.prefetches:
                # The read rewrites these pages; the scheduler indexes only
                # what it reports as read, so old garbage no longer matters.
                data.rewritten(job.pages)
                self._rank_l3.submit_prefetch(job, ready, by_layer=job.op_id in same_step_ops)
        loads = meta.loads
        unread: list[int] = []
        self._streamed = None
        if streamed:
            self._streamed = StreamedLoads(meta.same_step_loads, self._rank_l3.wait_layer,
                                           self._rank_l3.wait_read)
        elif meta.same_step_loads:  # copies wait (bounded) for this step's reads
            began = time.perf_counter()
            loads, unread = split_loads(loads, meta.same_step_loads, self._rank_l3.wait_read)
            self.counters.add(key("l3_same_step_wait_seconds"), time.perf_counter() - began)
        self._path().begin_step(loads, more_loads=streamed)
        self._path().fail_blocks(unread)

    def _run_storage_command(self, cmd: StorageCommand) -> None:
        """An admin prepare, commit, abort or detach of this rank's L3 client
        (l3/attach_worker.py)."""
        serving = self._rank_l3.io
        self._rank_l3.run(cmd, self._build_io)
        self.cfg = dataclasses.replace(self.cfg, storage=self._rank_l3.storage)
        if self._rank_l3.io is not serving:  # committed or detached
            self._node.follow(self._l3_pages())

    def _l3_pages(self):
        """The serving L3 client's page store (None: no L3)."""
        io = self._rank_l3.io
        return io.pages if io is not None else None

    def _build_io(self, storage: StorageConfig,
                  canary_pages: tuple[int, int] | None) -> StorageIO:
        if self.pool is None:
            raise RuntimeError("KV caches are not registered yet")
        cfg = dataclasses.replace(self.cfg, storage=storage)
        return build_storage_io(cfg, self.geom, self._vllm_config, self.pool, canary_pages)

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        if self._hybrid:
            for job in meta.async_loads:
                self._async_blocks[job.req_id] = frozenset(job.copy.block_ids)
        self._path().start_loads(meta.async_loads)
        # In-step loads before the forward reads their blocks (vLLM calls
        # this hook before it when a step has synchronous loads).
        self._drop_stores_over(
            self._node.start(meta.node_loads, self.transfer_tensors[0].device))

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self._node.load_layer(layer)
            if self._streamed is not None:
                self._gate_layer(self._streamed, layer)
            self._path().wait_layer(layer)

    def _gate_layer(self, streamed: StreamedLoads, layer: int) -> None:
        """Before layer ``layer``'s copies: wait for the same-step reads to
        deliver it, and take what did not arrive out of the copies."""
        data = self._path()
        waited_s = streamed.blocked_s
        gate = streamed.before_layer(layer)
        self.counters.add(key("l3_same_step_wait_seconds"), streamed.blocked_s - waited_s)
        if gate.loads:
            data.add_loads(gate.loads)
        for req_id in gate.failed_req_ids:
            data.fail_request(req_id)
        data.fail_blocks(gate.failed_blocks)

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        self._finish_streamed()  # pages copied unverified: checked before any store
        self._finish_node_loads()
        self._path().after_forward(meta.stores)
        if meta.stop_flush:
            self._rank_l3.hurry_backups()
        if meta.backups:
            ready = self._path().ready_event()
            for job in meta.backups:
                self._rank_l3.submit_backup(self._without_garbage(job), ready)

    def _finish_streamed(self) -> None:
        """The step's same-step pages that are not verified become load
        errors. Runs before the step's stores and before its load errors are
        collected, whichever vLLM calls first (speculative decoding defers
        ``wait_for_save`` past the collection)."""
        streamed, self._streamed = self._streamed, None
        if streamed is None:
            return
        waited_s = streamed.blocked_s
        self._path().fail_blocks(streamed.finish())
        self.counters.add(key("l3_same_step_wait_seconds"), streamed.blocked_s - waited_s)

    def _finish_node_loads(self) -> None:
        """The step's in-step node-tier loads that came short become load
        errors, and the step's stores are dropped (computed over missing
        KV). Runs where ``_finish_streamed`` does, for the same reason."""
        self._drop_stores_over(self._node.finish_in_step())

    def _drop_stores_over(self, blocks: set[int]) -> None:
        """In-step node-tier loads left ``blocks`` without their page (load
        errors, kept by ``self._node``): the step's stores, computed over
        them, are dropped."""
        if blocks:
            self._path().fail_blocks(sorted(blocks))

    def _without_garbage(self, job: BackupJob) -> BackupJob:
        """The backup minus pages whose store failed: an L3 object made from
        garbage would carry a valid checksum and poison every instance."""
        bad = self._path().unreadable(job.pages)
        if not bad:
            return job
        keep = [i for i, page in enumerate(job.pages) if page not in bad]
        # Not written: no L3 event may announce them (kv_events.py).
        self._backup_failures.setdefault(job.op_id, set()).update(
            h for h, page in zip(job.hashes, job.pages) if page in bad)
        return BackupJob(
            job.op_id, tuple(job.hashes[i] for i in keep), tuple(job.pages[i] for i in keep),
            tuple(job.states[i] for i in keep) if job.states else (), job.generation,
        )

    # --- completions -------------------------------------------------------

    def clear(self) -> None:
        self._meta = None
        self._finish_streamed()  # not left for a later step to miss
        self._finish_node_loads()
        if self.data is not None:
            self.data.end_step()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self.data is None:
            return None, None
        done = self.data.poll()
        done |= self._node.poll()
        if self._hybrid:
            self._fail_requests_of_load_errors(done)
        return None, (done or None)

    def _fail_requests_of_load_errors(self, done: set[str]) -> None:
        """Hybrid models: vLLM takes load failures only per request (block
        ids are unique only within a group), so failed blocks become the
        requests whose async load they belong to."""
        failed_blocks = self._path().take_load_errors()
        for req_id in done:
            blocks = self._async_blocks.pop(req_id, frozenset())
            if not blocks.isdisjoint(failed_blocks):
                self._failed_recving.add(req_id)

    def take_failed_recving(self) -> set[str]:
        """Requests whose async load failed (hybrid models), reported with
        (or after) their finished_recving."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def worker_meta(self) -> HiCacheWorkerMetadata | None:
        # Failed stores are reported with or without L3: the L2 index needs them.
        failed_pages = self.data.take_failed_store_pages() if self.data is not None else set()
        if self._meta is not None and self._meta.prefetch_wait_s > 0:
            # A read ending now rides on this report, not the next step's.
            self._rank_l3.wait_prefetches(self._meta.prefetch_wait_s)
        reports = self._rank_l3.take_reports()
        progress, backups = reports.prefetch, reports.backups
        storage_acks, self._rank_l3.acks = self._rank_l3.acks, {}
        timings = reports.timings  # taken after the poll (attach_worker._merge)
        backup_failures, self._backup_failures = self._backup_failures, {}
        for op_id, hashes in reports.failures.items():
            backup_failures.setdefault(op_id, set()).update(hashes)
        removed = reports.removed
        rank = self._rank_l3.worker_id
        node_counts = self._node_counts_report(rank)
        if (not progress and not backups and not failed_pages and not storage_acks
                and not backup_failures and not removed and not timings and not node_counts):
            return None
        return HiCacheWorkerMetadata(
            prefetch={op: {rank: p} for op, p in progress.items()},
            backups={op: {rank} for op in backups},
            failed_store_pages=failed_pages,
            storage_acks=storage_acks,
            backup_failures=backup_failures,
            l3_removed_keys=removed,
            prefetch_timing={op: {rank: t} for op, t in timings.items()},
            node_tier_counts=node_counts,
        )

    def _node_counts_report(self, rank: int) -> dict[int, NodeTierCounts]:
        """This rank's node tier totals, in every report once there are
        any: totals, not increments (common/node_counts.py), so a report
        vLLM drops is made good by the next step's."""
        if self._io is not None:
            self._node_counts.observe(self._io.pages.backend)
        totals = self._node_counts.totals
        return {} if totals == ZERO else {rank: totals}

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
            self._node_counts.observe(io.pages.backend)
            now = time.monotonic()
            if io.worker_id == 0 and now - self._l3_gauges_at >= 1.0:
                self._l3_gauges_at = now
                gauges = l3_usage_gauges(io.pages.backend)
        for k, v in self._rank_l3.take_retired_counts().items():  # a replaced backend's
            counts[k] = counts.get(k, 0) + v
        counts.update(self._node_counts.take_gained().samples())  # also gained in a report
        counts.update(self._node.take_counts())
        return counts, gauges

    def take_load_errors(self) -> set[int]:
        if self.data is None or self._hybrid:
            return set()  # hybrid: reported per request (take_failed_recving)
        self._finish_streamed()
        self._finish_node_loads()
        return self.data.take_load_errors() | self._node.take_errors()

    def shutdown(self) -> None:
        self._node.shutdown()  # its loader reads the tier L3 closes
        # L3 first: queued backups still read the pool.
        self._rank_l3.shutdown()
        if self.data is not None:
            self.data.shutdown()
        self.data = None
