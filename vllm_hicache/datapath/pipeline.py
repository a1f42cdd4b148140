"""The worker half's data movement L1 <-> L2, with no vLLM in sight.

``KVDataPath`` owns the host pool, the copy engine, the transfer stream and
its events, and the async loader. It takes plain descriptors (``jobs.py``);
the worker half (``connector/worker.py``) only translates vLLM's hooks and
the scheduler's metadata into these calls, once per step, in this order:

    before_forward(write_back)   handle_preemptions
    begin_step(loads)            bind_connector_metadata
    start_loads(async_loads)     start_load_kv
    wait_layer(i)                wait_for_layer_load, as attention layer i starts
    after_forward(stores)        wait_for_save
    end_step()                   clear_connector_metadata
    poll(), take_load_errors(), take_failed_store_pages()   completions

``ready_event()`` orders L3 work (which runs on threads, outside this
module) after every copy issued so far.

Ordering on CUDA (``stream`` set): every copy runs on one transfer stream,
so copies run in issue order: the stores of step N precede the loads of
step N+1, whatever blocks they share. A store first waits for the compute
stream (the forward that produced its KV); ``before_forward`` makes the
compute stream wait for the last stores, so no step overwrites a block
before its store has read it. Layerwise loads are all queued in
``start_loads`` with one event per layer; ``wait_layer(i)`` makes the
compute stream wait for layer i's event only, so layer i+1 loads while
layer i computes. On CPU (``stream`` None) every copy is synchronous and
layer i is loaded by ``wait_layer(i)`` itself.

Failure invariant (CPU and CUDA alike): a copy that raises never escapes.
A failed load becomes load errors for exactly its job's blocks (vLLM
recomputes them); a layerwise job that failed on one layer is not copied on
later layers, but every layer's event is still recorded, and that step's
stores are dropped as failed (the forward computed on top of missing KV). A
failed store leaves garbage in its host pages: they are reported once
(``take_failed_store_pages``) and, until a later store or an L3 read
rewrites them, no load reads them and ``unreadable`` names them to the L3
backup.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from vllm_hicache.common.jobs import NO_COPY, BlockCopy, LoadJob
from vllm_hicache.datapath.async_loads import AsyncLoader
from vllm_hicache.datapath.grouped import GroupedTransfer, copy_bytes
from vllm_hicache.host import HostKVPool
from vllm_hicache.kernels import DeviceKVLayout, KVTransfer, make_transfer

logger = logging.getLogger(__name__)


def allocate_pool(num_pages: int, layouts: Sequence[DeviceKVLayout], mem_layout: str,
                  device: torch.device) -> HostKVPool:
    """The host pool for these L1 layers, pinned (registered with CUDA,
    mapped for the kernels' UVA access) when the layers live on a GPU.
    Pinning can fail (memlock limit): check ``pool.is_pinned``."""
    return HostKVPool.for_layouts(num_pages, layouts, mem_layout,
                                  pin_memory=device.type == "cuda")


class _Untimed:
    """Stands in for a ``datapath.clock.CopyClock`` when nobody counts."""

    def start(self, stream=None):
        return None

    def stop(self, started, op: str, num_bytes: int, stream=None) -> None:
        pass


class KVDataPath:
    """Executes one worker's copies between its L1 tensors and its pool.

    ``transfer`` is a ``kernels.KVTransfer`` over ``pool`` (or anything with
    its ``store``/``load``/``load_layer``/``synchronize``); ``stream`` a CUDA
    stream for the copies, None for synchronous ones (CPU); ``clock`` a
    ``CopyClock``-like timer. ``timing_events``: layer events are created
    with timing, so a test or benchmark can place them on a timeline.
    """

    def __init__(self, pool: HostKVPool, transfer, *, stream=None, clock=None,
                 timing_events: bool = False) -> None:
        self.pool = pool
        self.num_layers = pool.num_layers
        self.stream = stream
        self._transfer = transfer
        self._clock = clock if clock is not None else _Untimed()
        self._timing_events = timing_events
        self.async_loads = AsyncLoader(transfer, stream, clock, pool.bytes_per_page)
        # This step's layerwise loads, and the layers not yet waited for.
        self._loads: list[LoadJob] = []
        self._pending_layers: set[int] = set()
        # CUDA: layer -> event after that layer's loads (all layers recorded).
        self._layer_events: dict[int, torch.cuda.Event] = {}
        # Layerwise jobs of this step that failed: skipped on later layers.
        self._failed_loads: set[str] = set()
        # Blocks whose load failed, not yet reported.
        self._load_errors: set[int] = set()
        # This step's forward runs without KV it was promised (fail_blocks).
        self._missing_kv = False
        # Pages whose latest L1 -> L2 store raised: garbage until rewritten.
        self._garbage_pages: set[int] = set()
        # Failed-store pages not yet reported.
        self._failed_store_pages: set[int] = set()
        # CUDA: event after the latest store (write-through or write-back).
        self._store_done: torch.cuda.Event | None = None

    @classmethod
    def build(cls, kv_tensors: Sequence[torch.Tensor], layouts: Sequence[DeviceKVLayout],
              pool: HostKVPool, io_backend: str, *, clock=None,
              timing_events: bool = False, group_layers: Sequence[range] = (),
              num_l1_blocks: int = 0) -> KVDataPath:
        """The copy engine named by the resolved ``io_backend`` over these
        tensors, and a transfer stream when they live on a GPU.

        ``group_layers``: for a hybrid model, each KV cache group's layer
        range; copies then name blocks by group block id (``grouped.py``)."""
        transfer: KVTransfer | GroupedTransfer = make_transfer(io_backend, kv_tensors,
                                                               layouts, pool)
        if len(group_layers) > 1:
            transfer = GroupedTransfer(transfer, group_layers, num_l1_blocks)
        device = kv_tensors[0].device
        stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        return cls(pool, transfer, stream=stream, clock=clock, timing_events=timing_events)

    @property
    def transfer(self):
        return self._transfer

    @transfer.setter
    def transfer(self, transfer) -> None:
        """Swap the copy engine (tests wrap it to inject failures)."""
        self._transfer = transfer
        self.async_loads.transfer = transfer

    # --- one step ------------------------------------------------------------

    def before_forward(self, write_back: BlockCopy = NO_COPY) -> None:
        """Before the step's forward can overwrite any block: the compute
        stream waits for the last stores, then ``write_back`` (blocks vLLM
        is handing to new requests) is copied to the host, and the compute
        stream waits for that too."""
        self._compute_waits_for_stores()
        if write_back:
            # Their KV may come from a forward still in flight: the store
            # waits for the compute stream.
            self._store(write_back, "write-back")
            # Even after a failure: part of the copy may still be queued.
            self._compute_waits_for_stores(record_now=True)

    def begin_step(self, loads: Sequence[LoadJob], more_loads: bool = False) -> None:
        """This step's layerwise loads; those reading garbage fail now.
        ``more_loads``: ``add_loads`` may bring some before the first layer."""
        self._loads = list(loads)
        self._pending_layers = (set(range(self.num_layers)) if self._loads or more_loads
                                else set())
        self._layer_events = {}
        self._failed_loads = set()
        self._missing_kv = False
        for job in self._loads:
            if self._reads_garbage(job):
                self._fail_load(job)

    def fail_blocks(self, block_ids: Sequence[int]) -> None:
        """After ``begin_step``: these L1 blocks get no KV this step (a
        same-step L3 read that did not arrive, l3/same_step.py). They are
        load errors, and the step's stores are dropped as after any failed load."""
        if block_ids:
            self._load_errors.update(block_ids)
            self._missing_kv = True

    def add_loads(self, loads: Sequence[LoadJob]) -> None:
        """CPU, before ``wait_layer`` of the step's first layer (a same-step
        read known only then, l3/same_step.py ``StreamedLoads``): more loads."""
        assert self.stream is None and len(self._pending_layers) == self.num_layers, \
            "loads added after a layer was loaded"
        self._loads += loads
        for job in loads:
            if job.req_id in self._failed_loads or self._reads_garbage(job):
                self._fail_load(job)

    def fail_request(self, req_id: str) -> None:
        """Stop ``req_id``'s loads of this step: none of its layers from now on
        is copied, and every block of its loads is a load error (what was
        copied before is incomplete). A request may have several loads (an
        L2 part, a same-step L3 part): they fail together."""
        self._failed_loads.add(req_id)
        for job in self._loads:
            if job.req_id == req_id:
                self._load_errors.update(job.copy.block_ids)

    def start_loads(self, async_loads: Sequence[LoadJob] = ()) -> None:
        """Issue the async loads, and on CUDA queue every layer's loads."""
        for job in async_loads:
            if self._reads_garbage(job):
                self.async_loads.fail(job)
            else:
                self.async_loads.submit(job)
        if self._loads and self.stream is not None:
            self._queue_layer_loads()

    def wait_layer(self, layer: int) -> None:
        """Layer ``layer`` is about to compute: its loads must be done (CUDA:
        the compute stream waits; CPU: they run now)."""
        if layer not in self._pending_layers:
            return
        self._pending_layers.discard(layer)
        if self.stream is None:
            self._load_layer(layer)
            return
        if not self._layer_events:  # start_loads was skipped: queue them now
            self._queue_layer_loads()
        torch.cuda.current_stream().wait_event(self._layer_events[layer])

    def after_forward(self, stores: BlockCopy = NO_COPY) -> None:
        """After the forward: write-through stores of the blocks it completed."""
        if self._pending_layers:
            self._finish_skipped_layers()
        if stores and (self._failed_loads or self._missing_kv):
            # This forward attended to KV that never arrived: what it computed
            # on top of it is wrong too. Which stored blocks depend on the
            # failed requests is unknown here, so none of these stores may
            # become L2 (or L3) content.
            logger.warning("HiCache: a load failed this step; its %d stores are dropped",
                           len(stores))
            self._mark_failed_stores(stores)
        elif stores:
            self._store(stores, "store")
            if self.stream is not None:
                self._store_done = self._record_event()

    def end_step(self) -> None:
        self._loads = []
        self._pending_layers = set()

    def ready_event(self):
        """CUDA: an event after every copy issued so far (L3 threads wait for
        it before touching the pages); CPU: None, copies are done."""
        return self._record_event() if self.stream is not None else None

    # --- garbage pages (failed stores) -------------------------------------------

    def rewritten(self, pages: Iterable[int]) -> None:
        """``pages`` are being rewritten by other means (an L3 read): what a
        failed store left in them no longer matters."""
        self._garbage_pages.difference_update(pages)

    def unreadable(self, pages: Iterable[int]) -> set[int]:
        """Those of ``pages`` whose latest store failed."""
        return self._garbage_pages.intersection(pages)

    # --- completions ------------------------------------------------------------

    def poll(self) -> set[str]:
        """Requests whose async load finished; failed blocks become load errors."""
        done, failed_blocks = self.async_loads.poll()
        self._load_errors.update(failed_blocks)
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_store_pages(self) -> set[int]:
        pages, self._failed_store_pages = self._failed_store_pages, set()
        return pages

    def wait_async_loads(self, timeout_s: float) -> bool:
        """Wait (bounded) for the async loads in flight; True if all are done."""
        return self.async_loads.wait_idle(timeout_s)

    def layer_event(self, layer: int):
        """CUDA: the event after layer ``layer``'s loads this step, if queued."""
        return self._layer_events.get(layer)

    @property
    def store_event(self):
        """CUDA: the event after the latest store, if any."""
        return self._store_done

    def shutdown(self) -> None:
        """Stop the async loader, wait for every copy, unpin the pool."""
        self.async_loads.shutdown()
        self._transfer.synchronize()
        self.pool.close()

    # --- loads ------------------------------------------------------------------

    def _load_layer(self, layer: int) -> None:
        started = self._clock.start()
        for job in self._loads:
            self._copy_layer(layer, job)
        self._clock.stop(started, "load", self._loaded_bytes() // self.num_layers)

    def _queue_layer_loads(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            started = self._clock.start(self.stream)
            for layer in range(self.num_layers):
                for job in self._loads:
                    self._copy_layer(layer, job)
                # Recorded whatever failed: wait_layer needs every event.
                self._layer_events[layer] = self._record_event()
            self._clock.stop(started, "load", self._loaded_bytes(), self.stream)

    def _finish_skipped_layers(self) -> None:
        """The forward skipped a layer hook: its KV was used unloaded. Load
        now for the cache's sake, and make vLLM recompute every load."""
        logger.warning("HiCache: layers %s were not loaded in time", sorted(self._pending_layers))
        if self.stream is not None and not self._layer_events:
            self._queue_layer_loads()
        for layer in sorted(self._pending_layers):
            if self.stream is None:
                self._load_layer(layer)
            else:  # queued already: later work on the compute stream waits
                torch.cuda.current_stream().wait_event(self._layer_events[layer])
        for job in self._loads:
            self._fail_load(job)
        self._pending_layers.clear()

    def _loaded_bytes(self) -> int:
        return sum(copy_bytes(self._transfer, j.copy.block_ids, self.pool.bytes_per_page)
                   for j in self._loads if j.req_id not in self._failed_loads)

    def _copy_layer(self, layer: int, job: LoadJob) -> None:
        if job.req_id in self._failed_loads:
            return  # its blocks are recomputed: more copies are wasted work
        try:
            self._transfer.load_layer(layer, job.copy.block_ids, job.copy.page_ids)
        except Exception:  # a failed copy must become a recompute, not a crash
            logger.exception("HiCache: layer %d load of %s failed", layer, job.req_id)
            self._fail_load(job)

    def _fail_load(self, job: LoadJob) -> None:
        self._load_errors.update(job.copy.block_ids)
        self.fail_request(job.req_id)

    def _reads_garbage(self, job: LoadJob) -> bool:
        if self._garbage_pages.isdisjoint(job.copy.page_ids):
            return False
        logger.warning("HiCache: load of %s reads pages whose store failed; recomputing",
                       job.req_id)
        return True

    # --- stores -----------------------------------------------------------------

    def _store(self, copy: BlockCopy, what: str) -> None:
        try:
            self._store_on_stream(copy)
        except Exception:  # a failed store costs cache, never the worker
            logger.exception(
                "HiCache: %s of %d blocks to host failed; their pages are dropped", what, len(copy)
            )
            # Which pages the copy reached before raising is unknown: all suspect.
            self._mark_failed_stores(copy)
            return
        self._garbage_pages.difference_update(copy.page_ids)

    def _store_on_stream(self, copy: BlockCopy) -> None:
        num_bytes = copy_bytes(self._transfer, copy.block_ids, self.pool.bytes_per_page)
        if self.stream is None:
            started = self._clock.start()
            self._transfer.store(copy.block_ids, copy.page_ids)
            self._clock.stop(started, "store", num_bytes)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            started = self._clock.start(self.stream)
            self._transfer.store(copy.block_ids, copy.page_ids)
            self._clock.stop(started, "store", num_bytes, self.stream)

    def _mark_failed_stores(self, copy: BlockCopy) -> None:
        self._garbage_pages.update(copy.page_ids)
        self._failed_store_pages.update(copy.page_ids)

    # --- streams (CUDA only) ----------------------------------------------------

    def _record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=self._timing_events)
        event.record(self.stream)
        return event

    def _compute_waits_for_stores(self, record_now: bool = False) -> None:
        if self.stream is None:
            return
        if record_now:
            self._store_done = self._record_event()
        if self._store_done is not None:
            torch.cuda.current_stream().wait_event(self._store_done)
