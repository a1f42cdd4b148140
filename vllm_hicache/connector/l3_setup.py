"""Builds the L3 tier's pieces for each half from the vLLM config.

Both halves derive the same key namespaces: the scheduler queries every TP
rank's keys (a prefix is in L3 only if all ranks wrote it; MLA has one copy),
each worker reads and writes its own.
"""

from __future__ import annotations

import os

from vllm_hicache.config import HiCacheConfig
from vllm_hicache.connector.geometry import KVGeometry
from vllm_hicache.connector.l3_scheduler import StoragePlanner
from vllm_hicache.connector.l3_worker import StorageIO
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage import StorageContext, create_backend
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.pages import PageStore

_RANDOM_SEEDED_HASHES = ("xxhash", "xxhash_cbor")


def check_shareable_hashes(vllm_config) -> None:
    """L3 is shared across processes: block hashes must be reproducible."""
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo in _RANDOM_SEEDED_HASHES and os.getenv("PYTHONHASHSEED") is None:
        raise ValueError(
            f"hicache_storage_backend needs block hashes that are equal in every "
            f"process, but prefix_caching_hash_algo={algo!r} is seeded randomly per "
            "process unless PYTHONHASHSEED is set. Set PYTHONHASHSEED to the same "
            "value for every instance sharing the L3 store, or use "
            "--prefix-caching-hash-algo sha256 (the default)."
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("hicache_storage_backend does not support pipeline parallelism yet")


def namespace(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, tp_rank: int) -> KeyNamespace:
    model = vllm_config.model_config
    ident = model.model + (f"@{model.revision}" if model.revision else "")
    return KeyNamespace(
        model=ident, kv_dtype=geom.kv_dtype, mem_layout=cfg.hicache_mem_layout,
        block_size=geom.block_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=tp_rank, is_mla=geom.is_mla,
    )


def build_planner(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, num_pages: int) -> StoragePlanner:
    storage = cfg.storage
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    ranks = [0] if geom.is_mla else list(range(tp_size))
    ctx = StorageContext("scheduler", 0, tp_size, HEADER_BYTES + geom.bytes_per_block)
    backend = create_backend(storage.backend, storage.backend_options, ctx)
    # SGLang's cap: 80% of what L2 holds beyond L1.
    cap = max(1, int(0.8 * (num_pages - geom.num_l1_blocks)))
    return StoragePlanner(
        storage, backend, [namespace(cfg, geom, vllm_config, r) for r in ranks],
        geom.block_size, world_size=tp_size, max_inflight_pages=cap,
    )


def build_storage_io(cfg: HiCacheConfig, geom: KVGeometry, vllm_config, pool) -> StorageIO:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    storage = cfg.storage
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
    ctx = StorageContext("worker", rank, tp_size, HEADER_BYTES + pool.bytes_per_page)
    backend = create_backend(storage.backend, storage.backend_options, ctx)
    pages = PageStore(backend, pool, namespace(cfg, geom, vllm_config, rank))
    return StorageIO(pages, rank, writes=not geom.is_mla or rank == 0)
