"""Same-step admission of an L3 hit (policy/same_step.py says when it is
used): the scheduler half's check that the engine can use it, and the
worker half's split of a step's same-step loads into what was read in time
and what becomes a load error.

The protocol, step N:

- scheduler: vLLM offers the waiting request a slot; its lookup has
  answered (``L3Planner.must_wait`` waits for it, bounded by the lookup
  budget of the pass), so its prefetch op starts at once, its pages
  allocated outside the tree. The request is admitted with its L2 part
  (a pinned LOAD op, as any L2 hit) and the op's pages behind it (a
  ``SameStepLoad``); the op's job leaves with this step's metadata.
- worker: ``bind`` submits the read, then waits, at most the job's
  ``wait_s``, for the read's verified prefix to cover the request's pages;
  the covered pages join the request's layerwise load, the rest are load
  errors: vLLM recomputes from the first one, and the step's stores are
  dropped (its forward ran on top of the missing KV), as for any failed load.
  On CPU the wait is spread over the forward instead (``StreamedLoads``):
  the store delivers the read layer by layer where it can, and the copy of
  layer i waits only for layer i of the read, then every page's check
  before the step's stores (below).
- scheduler, with step N's output: the op commits the pages every rank
  verified into the tree, as any prefetch.

Invariant: a page read for a same-step load is in no other use until its L1
copy has run: it stays outside the tree (allocated, owned by the op, never
evictable) until every rank has reported its read, and a rank reports only
after step N's forward, which ran (or gave up on) the copy. A read that
ends late or fails only shortens what is copied: never wrong KV.

Layer by layer, a page's bytes reach L1 before its object's check, which
covers the whole object, has run. That is safe because a check that fails
(or has not ended within the budget) still lands in the same step's
report: its block and the ones after it are load errors, vLLM drops the
token the step sampled for the request and recomputes from the first
failed block (``kv_load_failure_policy=recompute``), and the step's stores
are dropped. No unverified byte outlives the step.

Only for engines whose loads are synchronous and whose block ids are global
(one KV cache group, no state pages): an async load, or a hybrid model's
per-request failures, would need the wait elsewhere, so the option is
refused there (``check_engine``). No torch, no vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from vllm_hicache.common.jobs import BlockCopy, LoadJob, SameStepLoad
from vllm_hicache.storage_config import StorageConfig

# wait_read(generation, op_id, num_pages, timeout_s): leading pages of the
# op's read verified on this rank once they reach num_pages, the read ends,
# or timeout_s passes.
WaitRead = Callable[[int, int, int, float], int]
# wait_layer(generation, op_id, layer, num_pages, timeout_s): leading pages
# of the op's read whose layer is in the pool (verified or not), waiting as
# wait_read.
WaitLayer = Callable[[int, int, int, int, float], int]


def enabled(storage: StorageConfig | None) -> bool:
    return storage is not None and storage.same_step_read_wait_ms > 0


def check_engine(storage: StorageConfig | None, load_async: bool, hybrid: bool) -> None:
    """Refuse same_step_read_wait_ms on an engine that cannot use it."""
    if not enabled(storage):
        return
    assert storage is not None
    why = ("hicache_load_mode=async (the wait is part of a synchronous load)" if load_async
           else "a model with several KV cache groups or state pages (load errors are "
                "per request there)" if hybrid else None)
    if why is not None:
        raise ValueError(
            f"same_step_read_wait_ms={storage.same_step_read_wait_ms:g} in "
            f"hicache_storage_backend_extra_config is not supported with {why}; remove it")


def split_loads(loads: Sequence[LoadJob], same_step: Sequence[SameStepLoad],
                wait_read: WaitRead, clock: Callable[[], float] = time.monotonic,
                ) -> tuple[list[LoadJob], list[int]]:
    """The step's loads with each same-step load's read prefix appended to
    its request's load (one job per request: a failed job fails all its
    blocks), and the L1 blocks not read in time. Every wait is measured
    from the same start, so the step waits at most the longest ``wait_s``."""
    started = clock()
    by_req = {job.req_id: i for i, job in enumerate(loads)}
    out = list(loads)
    unread: list[int] = []
    for job in same_step:
        left_s = max(0.0, job.wait_s - (clock() - started))
        num = len(job.copy)
        read = max(0, min(num, wait_read(job.generation, job.op_id, num, left_s)))
        unread += job.copy.block_ids[read:]
        if read == 0:
            continue
        ready = BlockCopy(job.copy.block_ids[:read], job.copy.page_ids[:read])
        i = by_req.get(job.req_id)
        if i is None:
            by_req[job.req_id] = len(out)
            out.append(LoadJob(job.req_id, ready))
        else:
            prev = out[i].copy
            out[i] = LoadJob(job.req_id, BlockCopy(prev.block_ids + ready.block_ids,
                                                   prev.page_ids + ready.page_ids))
    return out, unread


class LayerGate(NamedTuple):
    """What the copy of one layer must change before it runs
    (``StreamedLoads.before_layer``)."""

    loads: list[LoadJob]      # same-step loads to copy from this layer on
    failed_req_ids: list[str]  # requests whose loads stop: every block a load error
    failed_blocks: list[int]  # L1 blocks never copied: load errors


class StreamedLoads:
    """One step's same-step loads on an engine whose copies run as the
    forward reaches each layer (CPU): the copy of layer i waits for layer i
    of the read, and the step's stores wait for every page's check.

    The worker half calls ``before_layer`` as each attention layer starts
    (in order) and ``finish`` before the step's stores; each returns what to
    fail. Waits add up: the step is held at most a job's ``wait_s`` in total
    (the time the forward computes in between is not counted). A load whose
    read delivered ``n`` pages of layer 0 copies those ``n`` (the blocks
    after them are load errors, as with ``split_loads``); if a later layer
    then has fewer, the request's whole load fails; pages copied but not
    verified by ``finish`` are load errors from the first one on."""

    def __init__(self, same_step: Sequence[SameStepLoad], wait_layer: WaitLayer,
                 wait_read: WaitRead, clock: Callable[[], float] = time.monotonic) -> None:
        self._jobs = list(same_step)
        self._wait_layer, self._wait_read, self._clock = wait_layer, wait_read, clock
        # Per job (same index): pages copied from layer 0 on; None until then.
        self._copied: list[int] | None = None
        self._failed: set[int] = set()  # jobs whose load stopped
        self.blocked_s = 0.0  # seconds the forward waited, in total

    def _timed(self, job: SameStepLoad, wait: Callable[..., int], *args: int) -> int:
        """``wait(generation, op_id, *args, timeout_s)`` for ``job``, with what
        is left of its budget."""
        started = self._clock()
        got = wait(job.generation, job.op_id, *args, max(0.0, job.wait_s - self.blocked_s))
        self.blocked_s += self._clock() - started
        return got

    def before_layer(self, layer: int) -> LayerGate:
        if self._copied is None:
            return self._first_layer(layer)
        failed: list[str] = []
        for i, (job, num) in enumerate(zip(self._jobs, self._copied)):
            if num == 0 or i in self._failed:
                continue
            if self._timed(job, self._wait_layer, layer, num) < num:
                self._failed.add(i)
                failed.append(job.req_id)
        return LayerGate([], failed, [])

    def _first_layer(self, layer: int) -> LayerGate:
        """The first layer's copy: what each read delivered of it fixes the
        pages copied."""
        loads: list[LoadJob] = []
        unread: list[int] = []
        self._copied = []
        for job in self._jobs:
            num = len(job.copy)
            got = max(0, min(num, self._timed(job, self._wait_layer, layer, num)))
            self._copied.append(got)
            unread += job.copy.block_ids[got:]
            if got:
                loads.append(LoadJob(job.req_id, BlockCopy(job.copy.block_ids[:got],
                                                           job.copy.page_ids[:got])))
        return LayerGate(loads, [], unread)

    def finish(self) -> list[int]:
        """Before the step's stores: the L1 blocks whose KV is not verified
        (never copied: no layer hook ran; or copied and then not confirmed
        by the read's checks within the budget). Failed requests' blocks are
        already load errors."""
        if self._copied is None:
            return [b for job in self._jobs for b in job.copy.block_ids]
        bad: list[int] = []
        for i, (job, num) in enumerate(zip(self._jobs, self._copied)):
            if num == 0 or i in self._failed:
                continue
            good = self._timed(job, self._wait_read, num)
            bad += job.copy.block_ids[max(0, good):num]
        return bad
