"""The backend each half of the L3 tier uses: the configured remote store,
or, with a node tier (``node_tier_bytes``), the node tier chained in front
of it (storage/node_chain.py).

Every process that builds a backend (the scheduler half for lookups, each
worker for reads and writes) joins the node tier as a member of its own;
the tier is named by ``node_tier_name`` and the rank-0 key namespace's tag,
which both halves derive alike, so every process of one deployment meets in
one tier and instances whose KV bytes differ never do.
"""

from __future__ import annotations

from vllm_hicache.config import HiCacheConfig
from vllm_hicache.node import NodeTier
from vllm_hicache.storage import StorageBackend, StorageContext, create_backend
from vllm_hicache.storage.node_chain import NodeChainBackend
from vllm_hicache.storage_config import NODE_ONLY_BACKEND, StorageConfig


def build_backend(cfg: HiCacheConfig, storage: StorageConfig, ctx: StorageContext,
                  identity: str) -> StorageBackend:
    """``identity``: the tier's identity (the rank-0 namespace's tag)."""
    remote = (None if storage.backend == NODE_ONLY_BACKEND
              else create_backend(storage.backend, storage.backend_options, ctx))
    if not cfg.node_tier_bytes:
        if remote is None:
            raise ValueError(f"backend {NODE_ONLY_BACKEND!r} needs node_tier_bytes > 0")
        return remote
    try:
        tier = NodeTier.join(cfg.node_tier_name, identity, cfg.node_tier_bytes,
                             ctx.object_bytes, root=cfg.node_tier_root)
    except BaseException:
        if remote is not None:
            remote.close()
        raise
    return NodeChainBackend({}, ctx, tier=tier, remote=remote)
