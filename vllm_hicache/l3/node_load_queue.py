"""Runs a worker's ``NodeLoadJob``s (node tier -> L1, no L2 page): async
ones off the forward's thread, reported as vLLM's async loads are; in-step
ones (``in_step``: the request was admitted with a synchronous load, as a
layerwise L2 hit is) on the calling thread before the forward.

Async: one background thread runs the jobs in order; on CUDA it queues the
copies on a stream of its own (never vLLM's compute stream) and the loader
waits for them before it releases the pages. ``poll`` returns the requests
whose job ended and the blocks that did not receive their page: the blocks
after the loaded prefix of each job (vLLM recomputes them). A job that
raises is all failed, and is still reported finished, or vLLM would wait
for it forever.

In step: ``start_in_step`` (before the forward) finds and checks the jobs'
pages; on CPU ``load_layer`` copies each layer as the forward reaches it
and ``finish_in_step`` (after the forward, before the step's stores)
checks the seals again and releases the pages; on CUDA ``start_in_step``
copies every layer at once (on the caller's stream, waited for). The
blocks that did not receive their page, known before the forward or after
it, are load errors of this step (``get_block_ids_with_load_errors``): vLLM
cuts the request's computed tokens back to the first of them and
recomputes from there. Either way the forward computed the request's later
blocks over KV that never arrived, so the worker drops the step's stores.

The lookups and checks stay on the forward's thread: run on the queue's
thread beside the forward's first layer, they made a cross-instance hit
slower (1.23 against 1.12 of an L2 hit, one ``bench_node_tier.py`` run each): the
forward does little before its first attention layer, and the two threads
took turns at the GIL.

Without a loader (this rank cannot read the tier in place) every job fails
at once, as a recompute. One loader serves both kinds, one job at a time.

Safety: the destination blocks belong to the request alone until it is
reported finished (async) or the step's forward runs after the copy
(in step); a source slot refilled during the copy fails the loader's second
seal check (or, off x86-64, is pinned by the loader for the copy's duration).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

import torch

from vllm_hicache import io_threads
from vllm_hicache.common.jobs import NodeLoadJob
from vllm_hicache.common.stats import Deltas, key
from vllm_hicache.kernels import DeviceKVLayout
from vllm_hicache.l3.node_loads import NodeDirectLoader, OpenLoad, build_direct_loader
from vllm_hicache.storage.node_chain import NodeChainBackend
from vllm_hicache.storage.pages import PageStore

logger = logging.getLogger(__name__)


class NodeLoadQueue:
    def __init__(self, loader: NodeDirectLoader | None, device: torch.device,
                 num_layers: int = 0) -> None:
        self.loader = loader
        self._device = device
        # CPU: in-step loads copy each layer as the forward reaches it (below).
        self._layerwise = device.type != "cuda" and num_layers > 0
        self._num_layers = num_layers
        # This step's in-step loads whose layers are still being copied.
        self._open: list[tuple[NodeLoadJob, OpenLoad | None]] = []
        self._layers_copied: set[int] = set()
        self._stream = (torch.cuda.Stream(device=device)
                        if loader is not None and device.type == "cuda" else None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hicache-node-load",
                                            initializer=io_threads.enter_io_thread)
        self._inflight: dict[str, tuple[NodeLoadJob, Future]] = {}
        # The loader's copy engine and verified-slot memory are not shared
        # between threads: one job at a time, async or in step.
        self._loader_lock = threading.Lock()
        self._pages = Deltas()
        # Pages loaded by loaders replaced since (replace_loader), and those
        # loaders until they close.
        self._pages_before = 0
        self._replaced: list[NodeDirectLoader] = []

    def submit(self, jobs: list[NodeLoadJob]) -> None:
        for job in jobs:
            self._inflight[job.req_id] = (job, self._executor.submit(self._run, job))

    def _run(self, job: NodeLoadJob) -> int:
        if self._stream is None:
            return self._load(job)
        with torch.cuda.stream(self._stream):
            return self._load(job)

    def _load(self, job: NodeLoadJob, in_step: bool = False) -> int:
        # In step, the forward waits for the load: its pages are released on
        # this queue's thread (the copy has ended; the transaction is only
        # bookkeeping).
        defer = self._executor.submit if in_step else None
        with self._loader_lock:  # the loader of the moment (replace_loader)
            if self.loader is None:
                return 0
            return self.loader.load(job.hashes, job.block_ids, defer)

    def replace_loader(self, loader: NodeDirectLoader | None) -> None:
        """Load from ``loader``'s tier from now on (None: every job fails,
        recomputed): the worker's L3 client changed between steps (an admin
        attach, replace or detach). An async job queued before runs with the
        loader in place when it starts (a page that loader does not find is
        a miss; the seal checks hold whichever tier it reads); the old
        loader closes on this queue's thread, after the jobs and deferred
        releases queued before it, so before its tier leaves (the retired
        client closes after a drain of seconds)."""
        assert not self._open, "a loader is replaced between steps only"
        with self._loader_lock:
            old, self.loader = self.loader, loader
            if old is not None:
                self._pages_before += old.counts["pages"]
        if loader is not None and self._stream is None and self._device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self._device)
        if old is not None and old is not loader:
            self._replaced.append(old)
            self._executor.submit(self._close_replaced, old)

    def _close_replaced(self, loader: NodeDirectLoader) -> None:
        with self._loader_lock:
            if loader in self._replaced:  # else shutdown closed it
                self._replaced.remove(loader)
                loader.close()

    def start_in_step(self, jobs: Sequence[NodeLoadJob]) -> set[int]:
        """This step's in-step loads, before its forward; the blocks that
        will not receive their page. On CPU only the lookups and checks run
        here, and ``load_layer`` copies each layer just before the forward's
        attention reads it (the copy is then still in the CPU's cache, as an
        L2 hit's layerwise load is; copying every layer up front cost the
        forward about 0.1 ms a layer on the demo model); ``finish_in_step``
        closes them. On CUDA the copies run here, waited for."""
        if not self._layerwise or self.loader is None:
            return self.load_in_step(jobs)
        failed: set[int] = set()
        for job in jobs:
            op = None
            try:
                with self._loader_lock:
                    op = self.loader.begin(job.hashes, job.block_ids)
            except Exception:  # never into the forward: the blocks are recomputed
                logger.exception("HiCache: node-tier load of %s failed", job.req_id)
            failed.update(job.block_ids[op.usable if op is not None else 0:])
            self._open.append((job, op))
        return failed

    def load_layer(self, layer: int) -> None:
        """Attention layer ``layer`` is about to run: copy its KV."""
        if not self._open or layer in self._layers_copied:
            return
        self._layers_copied.add(layer)
        assert self.loader is not None
        with self._loader_lock:
            for _, op in self._open:
                if op is not None:
                    self.loader.copy(op, layer)

    def finish_in_step(self) -> set[int]:
        """After the forward: the blocks of this step's in-step loads that
        did not receive their page after all (a copy failed, a seal changed,
        or the forward skipped a layer's hook, so it ran on KV not yet
        there). The forward used them: the caller drops the step's stores."""
        if not self._open:
            return set()  # also a second call: the first closed them
        complete = self._layers_copied >= set(range(self._num_layers))
        if not complete:
            logger.warning("HiCache: layers %s of a node-tier load were not copied in time",
                           sorted(set(range(self._num_layers)) - self._layers_copied))
        assert self.loader is not None
        late: set[int] = set()
        open_loads, self._open, self._layers_copied = self._open, [], set()
        for job, op in open_loads:
            if op is None:
                continue
            if not complete:
                op.failed = True
            loaded = 0
            try:
                with self._loader_lock:
                    loaded = self.loader.finish(op, self._executor.submit)
            except Exception:  # never into the forward: the blocks are recomputed
                logger.exception("HiCache: node-tier load of %s failed", job.req_id)
            late.update(job.block_ids[loaded:op.usable])
        return late

    def load_in_step(self, jobs: Sequence[NodeLoadJob]) -> set[int]:
        """Load ``jobs`` now, every layer (the forward reads their blocks
        next); the blocks that did not receive their page."""
        failed: set[int] = set()
        for job in jobs:
            loaded = 0
            if self.loader is not None:
                try:
                    loaded = self._load(job, in_step=True)
                except Exception:  # never into the forward: the blocks are recomputed
                    logger.exception("HiCache: node-tier load of %s failed", job.req_id)
            failed.update(job.block_ids[loaded:])
        return failed

    def take_counts(self) -> dict[str, float]:
        """Pages loaded into L1 since the last call (the
        ``node_tier_direct_loaded_pages`` counter); {} when none."""
        pages = self._pages_before + (self.loader.counts["pages"] if self.loader else 0)
        return self._pages.take({key("node_tier_direct_loaded_pages"): float(pages)})

    def poll(self) -> tuple[set[str], set[int]]:
        """Requests whose job ended since the last poll, and the blocks of
        theirs that were not loaded."""
        done: set[str] = set()
        failed: set[int] = set()
        for req_id, (job, future) in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            done.add(req_id)
            try:
                loaded = future.result()
            except Exception:  # never into the engine: the blocks are recomputed
                logger.exception("HiCache: node-tier load of %s failed", req_id)
                loaded = 0
            failed.update(job.block_ids[loaded:])
        return done, failed

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (bounded) for the jobs in flight; True if all ended."""
        _, pending = wait([f for _, f in self._inflight.values()], timeout=timeout_s)
        return not pending

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for loader in self._replaced:  # their close may have been cancelled
            loader.close()
        self._replaced.clear()
        if self.loader is not None:
            self.loader.close()


def has_node_tier(pages: object) -> bool:
    """Does this L3 client (its ``PageStore``) have a node tier in front?"""
    return isinstance(pages, PageStore) and isinstance(pages.backend, NodeChainBackend)


class L1Target(NamedTuple):
    """What a worker's node-tier loaders copy into: its rank's KV cache
    tensors, their layouts, and the copy backend (the worker's, after its
    platform fallbacks)."""

    kv_tensors: Sequence[torch.Tensor]
    layouts: Sequence[DeviceKVLayout]
    io_backend: str


def direct_loader(pages: object, l1: L1Target, hybrid: bool) -> NodeDirectLoader | None:
    """A loader from the node tier of this L3 client (``pages``) into ``l1``
    when its slots can be read in place (the scheduler half applies the
    same rules before it sends a job); None otherwise."""
    if not has_node_tier(pages):
        return None
    assert isinstance(pages, PageStore) and isinstance(pages.backend, NodeChainBackend)
    if hybrid:
        logger.info("HiCache node tier: hits are staged through L2 (several KV cache groups)")
        return None
    try:
        return build_direct_loader(pages.backend.tier, pages, l1.kv_tensors, l1.layouts,
                                   l1.io_backend)
    except ValueError as e:
        logger.info("HiCache node tier: %s; hits are staged through L2", e)
        return None


def node_load_queue(pages: object, l1: L1Target, hybrid: bool) -> NodeLoadQueue | None:
    """The queue of a worker whose L3 client (``pages``) has a node tier:
    with its ``direct_loader``, or one that fails its jobs where the slots
    cannot be read in place. None without a node tier."""
    if not has_node_tier(pages):
        return None
    return NodeLoadQueue(direct_loader(pages, l1, hybrid), l1.kv_tensors[0].device,
                         len(l1.kv_tensors))


class WorkerNodeLoads:
    """A worker's node-tier loads across steps and admin switches: which
    queue runs them (none until a job or a node tier needs one), which tier
    its loader reads (``follow``: the serving L3 client's), and the blocks
    that did not receive their page, not yet reported as load errors.

    The worker calls ``bind`` once its KV caches are registered, ``follow``
    when its L3 client changed, ``start`` / ``load_layer`` /
    ``finish_in_step`` around each forward, ``poll`` and ``take_errors``
    when vLLM collects completions, ``shutdown`` before its L3 client
    closes. The sets returned by ``start`` and ``finish_in_step`` are this
    step's short in-step blocks: the worker drops the step's stores over
    them (module doc)."""

    def __init__(self, hybrid: bool) -> None:
        self.queue: NodeLoadQueue | None = None
        self._hybrid = hybrid
        self._target: L1Target | None = None
        self._errors: set[int] = set()

    def bind(self, target: L1Target, pages: object) -> None:
        """The KV caches are registered: loaders copy into ``target``, from
        the tier of the L3 client ``pages`` (None: no L3)."""
        self._target = target
        self.queue = node_load_queue(pages, target, self._hybrid)

    def follow(self, pages: object) -> None:
        """The worker's serving L3 client is now ``pages`` (None: detached):
        the tier the scheduler half's hits come from. Jobs after a detach
        fail (recomputed)."""
        if self._target is None:
            return  # no KV caches yet: bind builds the queue
        if self.queue is None:
            self.queue = node_load_queue(pages, self._target, self._hybrid)
        else:
            self.queue.replace_loader(direct_loader(pages, self._target, self._hybrid))

    def start(self, jobs: Sequence[NodeLoadJob], device: torch.device) -> set[int]:
        """Before the step's forward: in-step jobs found and checked (on
        CUDA, copied), async ones queued. The in-step blocks short already."""
        if not jobs:
            return set()
        if self.queue is None:  # no node tier here: every job fails, recomputed
            self.queue = NodeLoadQueue(None, device)
        # In-step ones first: the forward waits for them, not for the queue.
        short = self._short(self.queue.start_in_step([job for job in jobs if job.in_step]))
        self.queue.submit([job for job in jobs if not job.in_step])
        return short

    def load_layer(self, layer: int) -> None:
        if self.queue is not None:
            self.queue.load_layer(layer)

    def finish_in_step(self) -> set[int]:
        """After the forward, before its stores: the in-step blocks short."""
        return self._short(self.queue.finish_in_step()) if self.queue is not None else set()

    def poll(self) -> set[str]:
        """Requests whose async job ended (their short blocks kept for
        ``take_errors``)."""
        if self.queue is None:
            return set()
        done, failed = self.queue.poll()
        self._errors |= failed
        return done

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_counts(self) -> dict[str, float]:
        return self.queue.take_counts() if self.queue is not None else {}

    def shutdown(self) -> None:
        if self.queue is not None:
            self.queue.shutdown()
            self.queue = None

    def _short(self, blocks: set[int]) -> set[int]:
        self._errors |= blocks
        return blocks
