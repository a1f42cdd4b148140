"""Every place where vllm_hicache reaches into vLLM internals (private
attributes, call-stack shape, sentinels), one function each, with what in
vLLM would break it. Anything here must degrade to "feature unavailable",
never to a failed engine: vLLM changes these without notice.

Checked against vLLM 0.32 (``vllm/v1/engine/core.py``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType

logger = logging.getLogger(__name__)


def engine_loop_waker() -> Callable[[], None] | None:
    """A callable that wakes this process's idle EngineCore busy loop, or
    None where there is none to wake (an in-process engine, a test harness).

    Why: an idle ``EngineCoreProc`` blocks in ``_process_input_queue`` on
    ``input_queue.get()`` and looks at ``has_work()`` (which includes the
    connector's ``has_pending_push_work``) only when something arrives there.
    The admin API thread (admin/api.py) queues a command for the scheduler
    half, which makes ``has_pending_push_work`` true; this callable then puts
    vLLM's own ``WAKEUP`` sentinel (what its shutdown path uses to wake the
    same loop; ``_handle_client_request`` ignores it) into that queue, so the
    loop re-checks ``has_work()`` and runs a step, in which the command runs.

    How the queue is found: the scheduler half is built while
    ``EngineCoreProc.__init__`` runs (it creates ``input_queue`` before it
    calls ``EngineCore.__init__``, which builds the Scheduler and so this
    connector), so one frame up the stack has ``self`` = that EngineCoreProc.
    Call it from the connector's constructor.

    Breaks if vLLM: builds the scheduler outside EngineCoreProc construction
    (then None: admin commands wait for the next step some request causes);
    renames ``EngineCoreProc``, ``input_queue`` or
    ``EngineCoreRequestType.WAKEUP``; or starts treating WAKEUP as anything
    but a no-op (then None or a wrong wake-up; tests/e2e/test_admin_api.py
    catches both: an idle server must answer admin calls).
    """
    try:
        from vllm.v1.engine import EngineCoreRequestType
        wakeup = EngineCoreRequestType.WAKEUP
    except (ImportError, AttributeError):
        logger.debug("vLLM has no EngineCoreProc/WAKEUP: admin commands run on the next step")
        return None
    owner = _engine_core_proc_on_stack()
    if owner is None:
        return None
    queue = getattr(owner, "input_queue", None)
    if queue is None or not hasattr(queue, "put_nowait"):
        return None
    return lambda: queue.put_nowait((wakeup, None))


def _engine_core_proc_on_stack() -> object | None:
    """The ``EngineCoreProc`` whose construction is on the call stack, if any
    (see ``engine_loop_waker`` for why it is there)."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            return owner
        frame = frame.f_back
    return None


def engine_stop_flag() -> Callable[[], bool] | None:
    """A callable that says whether this process's EngineCore has been asked
    to stop (SIGTERM or SIGINT), or None where there is no EngineCore
    process (an in-process engine, a test harness).

    Why: on a stop, vLLM's EngineCore keeps stepping while ``has_work()``
    (which includes the connector's ``has_pending_push_work``) until its
    parent kills it ``--shutdown-timeout`` seconds after the signal, and
    tells the connector nothing. The scheduler half needs to know the stop
    began to write its queued L3 backups out before that kill and to count
    what did not fit (scheduler/graceful_stop.py). vLLM's own signal handler
    (``run_engine_core``) sets ``EngineCoreProc.shutdown_state`` away from
    ``EngineShutdownState.RUNNING``; the flag reads it. Call it from the
    connector's constructor (the EngineCoreProc is found on the stack, as in
    ``engine_loop_waker``).

    Breaks if vLLM renames ``shutdown_state`` or ``EngineShutdownState
    .RUNNING``, or builds the scheduler outside EngineCoreProc construction:
    then None, and a stop writes out only what the workers' shutdown drain
    finishes; tests/e2e/test_graceful_stop.py notices (no stop line).
    """
    try:
        from vllm.v1.engine.core import EngineShutdownState
        running = EngineShutdownState.RUNNING
    except (ImportError, AttributeError):
        return None
    owner = _engine_core_proc_on_stack()
    if owner is None or not hasattr(owner, "shutdown_state"):
        return None
    return lambda: owner.shutdown_state != running


def shutdown_timeout_s(vllm_config) -> int:
    """vLLM's ``--shutdown-timeout`` (``VllmConfig.shutdown_timeout``): how
    long a stopping EngineCore may keep stepping before its parent kills it;
    0 (vLLM's default) kills it at once.

    Breaks if vLLM renames the field: then 0, the most cautious reading (the
    start warning says a stop loses the queued backups).
    """
    return int(getattr(vllm_config, "shutdown_timeout", 0) or 0)


# --- vLLM's BlockPool (the L1 prefix cache), handed over by bind_gpu_block_pool


def watch_block_pool(pool, on_reuse: Callable[[object], None],
                     on_reset: Callable[[list[tuple[bytes, int]]], None]) -> None:
    """Call ``on_reuse(block)`` for each cached block vLLM is about to hand
    out again (its KV is about to be overwritten), and ``on_reset(cached)``
    with the ``(block_hash, block_id)`` of every cached block a successful
    ``reset_prefix_cache`` dropped (taken before the reset clears them).

    Why: write-back (write_back.py) copies a block to L2 only when L1 is about
    to lose it, and vLLM 0.32 gives connectors no eviction callback. So the
    pool's allocation path is wrapped: ``get_new_blocks`` calls
    ``_maybe_evict_cached_block`` for every block it takes from the free
    queue, and a call inside ``get_new_blocks`` is a reuse (``evict_blocks``
    calls it too, for blocks whose load failed: those must not reach L2).

    Breaks if vLLM: renames ``BlockPool.get_new_blocks``,
    ``_maybe_evict_cached_block``, ``reset_prefix_cache`` or ``blocks``;
    evicts cached blocks on another path; or changes ``block_hash`` /
    ``block_id`` on its blocks. Write-back then stores nothing (or raises at
    start on a rename); tests/scheduler/test_write_back.py and the write_back
    rows of tests/e2e/test_engine_matrix.py fail.
    """
    get_new_blocks = pool.get_new_blocks
    maybe_evict = pool._maybe_evict_cached_block
    reset = pool.reset_prefix_cache
    in_alloc = [False]

    def watched_get_new_blocks(num_blocks: int):
        in_alloc[0] = True
        try:
            return get_new_blocks(num_blocks)
        finally:
            in_alloc[0] = False

    def watched_maybe_evict(block) -> bool:
        if in_alloc[0] and block.block_hash is not None:
            on_reuse(block)
        return maybe_evict(block)

    def watched_reset() -> bool:
        cached = [(b.block_hash, b.block_id) for b in pool.blocks if b.block_hash is not None]
        ok = reset()
        if ok:
            on_reset(cached)
        return ok

    pool.get_new_blocks = watched_get_new_blocks
    pool._maybe_evict_cached_block = watched_maybe_evict
    pool.reset_prefix_cache = watched_reset


def l1_has_block(pool, block_hash: bytes) -> bool:
    """Is this block hash cached in vLLM's L1 (first KV cache group)?

    Breaks if vLLM changes ``BlockPool.get_cached_block(block_hash,
    kv_cache_group_ids)`` (a public method of an internal class): L3 lookups
    then start at block 0 and look up blocks L1 already has (slower, never
    wrong); tests/l3/test_planner.py notices.
    """
    return pool.get_cached_block(block_hash, [0]) is not None


def l1_block_id(pool, block_hash: bytes) -> int | None:
    """The id of the L1 block caching this block hash (first KV cache
    group), None if L1 does not have it.

    Breaks as ``l1_has_block``; then a graceful stop under write-back copies
    nothing from L1 (tests/scheduler/test_graceful_stop.py notices).
    """
    blocks = pool.get_cached_block(block_hash, [0])
    return blocks[0].block_id if blocks else None


def drop_l1_blocks(pool, block_ids: set[int]) -> None:
    """Take these blocks out of vLLM's prefix cache (their KV is wrong).

    Breaks if vLLM renames ``BlockPool.evict_blocks``; then a block whose load
    failed could be hit by another request before it is recomputed:
    tests/scheduler/test_scheduler_hardening.py
    (test_failed_load_leaves_vllms_prefix_cache_too) fails.
    """
    pool.evict_blocks(block_ids)


def null_block_id(pool) -> int:
    """The id of vLLM's null block: what a sliding-window group's block table
    holds at positions outside the window (hybrid allocator).

    Breaks if vLLM renames ``BlockPool.null_block``: then 0, the id the pool
    gives it today (it is the first block taken from the free queue). A wrong
    id would let a store copy a freed sliding-window block;
    tests/e2e/test_hybrid_engine.py compares outputs with recomputation.
    """
    block = getattr(pool, "null_block", None)
    return block.block_id if block is not None else 0


def l1_block_holds(pool, block_id: int, block_hash: bytes, group: int,
                   num_tokens: int) -> bool:
    """Does L1 block ``block_id`` carry, in KV cache group ``group``, the hash
    of the ``num_tokens``-token prefix ending at its boundary?

    For a Mamba group in vLLM's ``align`` mode this is vLLM's own promise
    (the one its prefix cache serves hits from) that, once the scheduled
    forward has run, the block holds the recurrent state of the prefix ending
    at that block's boundary: vLLM hashes a state block when the forward that
    ends on its boundary is scheduled (a chunk end, a decode step, a prefill
    checkpoint), and a block handed to another request loses its hash.

    Breaks if vLLM renames ``BlockPool.blocks``, ``KVCacheBlock.block_hash``
    or ``block_hash_num_tokens``, or changes the packing of
    ``make_block_hash_with_group_id``: then False (no Mamba page is stored,
    never a wrong one); tests/e2e/test_hybrid_mamba.py notices (no hits).
    """
    try:
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        block = pool.blocks[block_id]
        key = block.block_hash
        if key is None or get_group_id(key) != group or get_block_hash(key) != block_hash:
            return False
        covered = getattr(block, "block_hash_num_tokens", None)
        return covered is None or covered == num_tokens
    except (AttributeError, IndexError, TypeError):
        return False


def cpu_compute_cores(vllm_config) -> set[int]:
    """The cores vLLM's CPU backend binds the compute threads of this
    host's ranks to (every local rank's list); empty on other platforms or
    when binding is off (``VLLM_CPU_OMP_THREADS_BIND=nobind``).

    Why: the connector's I/O threads should run elsewhere (io_threads.py).
    vLLM computes these lists in ``OMPProcessManager`` (its "auto" mode
    depends on NUMA and SMT layout), so we ask it rather than redo it.

    Breaks if vLLM moves or renames ``vllm.utils.ompmultiprocessing
    .OMPProcessManager`` or its ``cpu_lists``: then empty, and the I/O
    threads stay on the compute cores (slower, never wrong).
    """
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return set()
        from vllm.utils.ompmultiprocessing import OMPProcessManager
    except ImportError:
        return set()
    manager_log = logging.getLogger("vllm.utils.ompmultiprocessing")
    level = manager_log.level
    manager_log.setLevel(logging.ERROR)  # it logged its lists and warnings once already
    try:
        lists = OMPProcessManager(vllm_config).cpu_lists
    except Exception as exc:  # noqa: BLE001 - a layout vLLM itself would reject later
        logger.debug("HiCache: vLLM's CPU binding unknown (%s): I/O threads not moved", exc)
        return set()
    finally:
        manager_log.setLevel(level)
    return {int(cpu) for cpus in lists for cpu in cpus}
