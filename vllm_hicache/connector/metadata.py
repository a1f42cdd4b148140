"""Wire types between the two halves of the connector.

Scheduler -> workers, once per step: ``HiCacheMetadata``. Its operations are
executed by every worker in this order, and step N's operations finish before
step N+1's start (stores of step N before loads of step N+1):

1. ``evict_stores``: write-back copies L1 -> L2 of blocks vLLM is handing to
   new requests this step; run before the forward overwrites them.
2. ``loads``: L2 -> L1 for requests scheduled this step (layer by layer in
   layerwise mode, overlapped with the forward).
3. ``async_loads``: L2 -> L1 for requests waiting in WAITING_FOR_REMOTE_KVS;
   completion is reported through ``get_finished``.
4. ``stores``: write-through copies L1 -> L2 of blocks completed by this
   step's forward; run after the forward.

Everything here must pickle: it crosses from EngineCore to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class BlockCopy:
    """Pairs of (vLLM block id, host page id), matched by position."""

    block_ids: tuple[int, ...] = ()
    page_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.page_ids), (
            len(self.block_ids),
            len(self.page_ids),
        )

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class LoadJob:
    """Load host pages into one request's blocks."""

    req_id: str
    copy: BlockCopy


@dataclass
class HiCacheMetadata(KVConnectorMetadata):
    evict_stores: BlockCopy = field(default_factory=BlockCopy)
    loads: list[LoadJob] = field(default_factory=list)
    async_loads: list[LoadJob] = field(default_factory=list)
    stores: BlockCopy = field(default_factory=BlockCopy)

    def is_empty(self) -> bool:
        return not (
            self.evict_stores or self.loads or self.async_loads or self.stores
        )


def merge_copies(pairs: list[tuple[int, int]]) -> BlockCopy:
    """Build a BlockCopy from (block id, page id) pairs."""
    if not pairs:
        return BlockCopy()
    blocks, pages = zip(*pairs)
    return BlockCopy(tuple(blocks), tuple(pages))
