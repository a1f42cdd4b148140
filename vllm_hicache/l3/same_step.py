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
- scheduler, with step N's output: the op commits the pages every rank
  verified into the tree, as any prefetch.

Invariant: a page read for a same-step load is in no other use until its L1
copy has run: it stays outside the tree (allocated, owned by the op, never
evictable) until every rank has reported its read, and a rank reports only
after step N's forward, which ran (or gave up on) the copy. A read that
ends late or fails only shortens what is copied: never wrong KV.

Only for engines whose loads are synchronous and whose block ids are global
(one KV cache group, no state pages): an async load, or a hybrid model's
per-request failures, would need the wait elsewhere, so the option is
refused there (``check_engine``). No torch, no vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from vllm_hicache.common.jobs import BlockCopy, LoadJob, SameStepLoad
from vllm_hicache.storage_config import StorageConfig

# wait_read(generation, op_id, num_pages, timeout_s): leading pages of the
# op's read verified on this rank once they reach num_pages, the read ends,
# or timeout_s passes.
WaitRead = Callable[[int, int, int, float], int]


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
