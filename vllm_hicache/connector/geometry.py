"""What the connector needs to know about the model's KV cache, and L2 sizing.

Both halves derive the same ``KVGeometry`` and the same number of host pages
from ``(HiCacheConfig, KVCacheConfig)``, so page numbering agrees without any
message between them. A model the connector cannot serve is refused here, at
engine start, with a message saying why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec

from vllm_hicache.config import HiCacheConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVGeometry:
    # Tokens per vLLM block == tokens per host page.
    block_size: int
    # Attention layers in model order (the host page holds all of them).
    layer_names: tuple[str, ...]
    # Bytes of one block across all layers, on this rank.
    bytes_per_block: int
    # Blocks in vLLM's KV cache (L1).
    num_l1_blocks: int
    num_kv_heads: int
    head_size: int
    is_mla: bool
    # KV element type, e.g. "bfloat16" (part of L3 keys).
    kv_dtype: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


def geometry_from(kv_cache_config: KVCacheConfig) -> KVGeometry:
    """Describe the KV cache; raise ValueError for models we cannot serve."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            "HiCacheConnector supports models with one KV cache group (full "
            f"attention or MLA); this model has {len(groups)} groups "
            f"({[type(g.kv_cache_spec).__name__ for g in groups]}). Hybrid "
            "models (sliding window + full, Mamba) are not supported yet."
        )
    spec = groups[0].kv_cache_spec
    # A FullAttentionSpec may carry a sliding window (vLLM without its hybrid
    # allocator): blocks then still hold every token's KV, so pages are exact.
    if not isinstance(spec, FullAttentionSpec):
        raise ValueError(
            "HiCacheConnector supports full-attention and MLA KV caches only; "
            f"got {type(spec).__name__}"
        )
    hash_block_size = kv_cache_config.hash_block_size
    if hash_block_size is not None and hash_block_size != spec.block_size:
        raise ValueError(
            f"HiCacheConnector needs hash_block_size == block_size; got "
            f"{hash_block_size} != {spec.block_size}"
        )
    layer_names = tuple(groups[0].layer_names)
    return KVGeometry(
        block_size=spec.block_size,
        layer_names=layer_names,
        bytes_per_block=spec.page_size_bytes * len(layer_names),
        num_l1_blocks=kv_cache_config.num_blocks,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        is_mla=isinstance(spec, MLAAttentionSpec),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
    )


def host_num_pages(cfg: HiCacheConfig, geom: KVGeometry) -> int:
    """L2 pages: hicache_size GB per rank if set, else hicache_ratio x L1."""
    if cfg.host_bytes_override > 0:
        num_pages = cfg.host_bytes_override // max(1, geom.bytes_per_block)
        if num_pages < 1:
            raise ValueError(
                f"hicache_size={cfg.hicache_size} GB holds no page: one page "
                f"(a block of all {geom.num_layers} layers) is "
                f"{geom.bytes_per_block} bytes"
            )
        return int(num_pages)
    return int(geom.num_l1_blocks * cfg.hicache_ratio)
