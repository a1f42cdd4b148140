"""Copies the workers report as failed: what the scheduler half drops.

A failed load is an L2 -> L1 copy a worker could not make (the page is
unreadable); a failed store an L1 -> L2 copy (the page holds garbage). The
workers report them in each step's ``KVConnectorOutput``:

- ``invalid_block_ids``: the L1 blocks of failed loads (one KV-cache group);
- ``failed_recving``: requests whose async load failed as a whole (hybrid
  models, whose block ids are unique only within a group: docs/design.md);
- ``kv_connector_worker_meta.failed_store_pages``: the L2 pages of failed stores.

Invariant (docs/design.md, invariant 1): a page whose copy failed is never a
hit again. So, for every failure reported:

- the L2 index loses the page and every block below it on its chain
  (``HiRadixTree.invalidate``), counted as invalidated pages; failed loads
  count their blocks as load errors;
- vLLM's prefix cache (L1) loses each failed block and every later block of
  the request that owns it, from its first failed block on: under
  kv_load_failure_policy=recompute vLLM truncates the request there and
  recomputes, but keeps those blocks cached meanwhile, where another request
  would hit them (and we would store what it read);
- pins are not touched: a page stays pinned by its operation (page_ops.py)
  until that operation's terminal event, as any other; a pinned page leaves
  the index at once and goes free when its last pin goes.

HiCacheScheduler builds one ``FailedCopies`` and calls it on the engine
thread: ``bind`` from ``bind_gpu_block_pool``; ``drop_failed_requests`` first
in ``update_connector_output`` (the failed async loads' ops must still be
live: the same output's ``finished_recving`` closes them right after), and
``drop_failed_copies`` last in it. It mutates the L2 tree, vLLM's block pool
and the load-error and invalidated counters; never the page ops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Protocol

from vllm_hicache.common.page_ops import OpKind, PageOps
from vllm_hicache.common.stats import HiCacheStats
from vllm_hicache.connector.metadata import HiCacheWorkerMetadata
from vllm_hicache.connector.vllm_compat import drop_l1_blocks
from vllm_hicache.index import HiRadixTree

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.outputs import KVConnectorOutput


class BlockTable(Protocol):
    """A request's record as this module reads it (request_state.ReqState)."""

    @property
    def block_ids(self) -> Sequence[int]:
        """The request's L1 blocks, block 0 first (KV-cache group 0)."""
        ...


class FailedCopies:
    """Drops what the workers' failed copies leave wrong, in L2 and in L1."""

    def __init__(self, tree: HiRadixTree, ops: PageOps, stats: HiCacheStats,
                 block_tables: Mapping[str, BlockTable]) -> None:
        self._tree = tree
        self._ops = ops
        self._stats = stats
        # The scheduler's live request records, by request id (read only).
        self._block_tables = block_tables
        self._block_pool: BlockPool | None = None

    def bind(self, block_pool: BlockPool) -> None:
        """Evict failed blocks from ``block_pool`` (vLLM's L1) from now on."""
        self._block_pool = block_pool

    def drop_failed_requests(self, output: KVConnectorOutput) -> None:
        """The async loads of ``output.failed_recving``; call it before the
        same output's ``finished_recving`` closes their ops."""
        failed_reqs = getattr(output, "failed_recving", None)
        if failed_reqs:
            self._drop_failed_loads(failed_reqs)

    def drop_failed_copies(self, output: KVConnectorOutput,
                           meta: HiCacheWorkerMetadata | None) -> None:
        """The failed loads' L1 blocks and the failed stores' L2 pages."""
        failed_pages = meta.failed_store_pages if meta is not None else set()
        if output.invalid_block_ids or failed_pages:
            self._drop_failed(set(output.invalid_block_ids or ()), failed_pages)

    def _drop_failed(self, l1_blocks: set[int], pages: set[int]) -> None:
        """Copies failed: the pages involved must never be hits again (a
        failed load means the page is unreadable, a failed store that it
        holds garbage); vLLM recomputes the blocks."""
        self._stats.record_load_errors(len(l1_blocks))
        for chain in list(self._ops.recent_uses(l1_blocks=l1_blocks, pages=pages)):
            self._stats.record_invalidated(self._tree.invalidate(chain, len(chain) - 1))
        if l1_blocks and self._block_pool is not None:
            # Under kv_load_failure_policy=recompute vLLM keeps the failed
            # blocks (and those computed on top of them) in its prefix cache
            # until the request recomputes them: any request scheduled
            # meanwhile would hit them, and we would store what it read.
            drop_l1_blocks(self._block_pool, self._blocks_from_first_failure(l1_blocks))

    def _drop_failed_loads(self, req_ids: Set[str]) -> None:
        """Async loads failed as a whole (hybrid models report failures per
        request): their pages must never be hits again; vLLM recomputes."""
        for op in self._ops.live(OpKind.ASYNC_LOAD):
            if op.req_id in req_ids:
                rng = op.ranges[0]
                self._stats.record_load_errors(len(rng.blocks))
                first = rng.blocks[0]
                self._stats.record_invalidated(self._tree.invalidate(rng.chain[: first + 1], first))

    def _blocks_from_first_failure(self, l1_blocks: set[int]) -> set[int]:
        """The failed blocks, and every later block of the requests that own
        them (computed this step over the missing KV)."""
        doomed = set(l1_blocks)
        for state in self._block_tables.values():
            ids = state.block_ids
            first = next((i for i, b in enumerate(ids) if b in l1_blocks), None)
            if first is not None:
                doomed.update(ids[first:])
        return doomed
