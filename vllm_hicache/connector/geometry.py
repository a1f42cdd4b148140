"""What the connector needs to know about the model's KV cache, and L2 sizing.

Both halves derive the same ``KVGeometry`` and the same number of host pages
from ``(HiCacheConfig, KVCacheConfig, VllmConfig)``, so page numbering agrees
without any message between them. A model the connector cannot serve is
refused here, at engine start, with a message saying why.

Pipeline parallelism: each worker's KVCacheConfig holds only its stage's
layers, and the scheduler's is a copy of the first worker's (vLLM's
``generate_scheduler_kv_cache_config``). A page is one block of *all* of a
stage's layers, so with ``hicache_size`` a stage with more layers would fit
fewer pages than the scheduler hands out. Every process therefore sizes L2 by
the largest stage, which all of them compute alike from the model config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec

from vllm_hicache.config import HiCacheConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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
    # Layers of the pipeline stage with the most layers: L2 is sized by its
    # page bytes so that every stage, and the scheduler, count the same pages.
    # 0: this rank's own layer count (no pipeline parallelism).
    sizing_num_layers: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def sizing_bytes_per_block(self) -> int:
        """Bytes of one block on the largest pipeline stage (this rank without PP)."""
        bytes_per_layer_block = self.bytes_per_block // max(1, self.num_layers)
        return bytes_per_layer_block * (self.sizing_num_layers or self.num_layers)


def pp_stage_num_layers(vllm_config: VllmConfig) -> list[int]:
    """Decoder layers of each pipeline stage, as vLLM partitions the model.

    The only reach into vLLM internals for pipeline parallelism: models pick
    their layers with ``vllm.distributed.utils.get_pp_indices`` (honouring
    ``VLLM_PP_LAYER_PARTITION``), from the total decoder layer count. The
    result depends only on the model config, the PP size and that variable,
    which every process of one engine shares, so every process gets the same
    list. Decoder layers without KV (no-op blocks, shared KV) make a stage's
    count an upper bound on its KV layers, which only makes the pool smaller.
    """
    from vllm.distributed.utils import get_pp_indices

    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    total_layers = vllm_config.model_config.get_total_num_hidden_layers()
    counts = []
    for stage in range(pp_size):
        start, end = get_pp_indices(total_layers, stage, pp_size)
        counts.append(end - start)
    return counts


def geometry_from(
    kv_cache_config: KVCacheConfig, vllm_config: VllmConfig | None = None
) -> KVGeometry:
    """Describe the KV cache; raise ValueError for models we cannot serve.

    ``vllm_config`` is needed for pipeline parallelism (L2 sizing by the
    largest stage); without it the geometry describes this rank alone.
    """
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
    sizing_num_layers = 0  # without PP every process holds the same layers
    if vllm_config is not None and vllm_config.parallel_config.pipeline_parallel_size > 1:
        stage_num_layers = pp_stage_num_layers(vllm_config)
        if len(layer_names) > max(stage_num_layers):
            # Our model of vLLM's partition is wrong for this model: the pool
            # would outgrow hicache_size, so refuse rather than guess.
            raise ValueError(
                f"HiCacheConnector sizes L2 by the largest pipeline stage, "
                f"{max(stage_num_layers)} layers (stages {stage_num_layers}), but "
                f"this stage's KV cache has {len(layer_names)} layers"
            )
        sizing_num_layers = max(stage_num_layers)
    return KVGeometry(
        block_size=spec.block_size,
        layer_names=layer_names,
        bytes_per_block=spec.page_size_bytes * len(layer_names),
        sizing_num_layers=sizing_num_layers,
        num_l1_blocks=kv_cache_config.num_blocks,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        is_mla=isinstance(spec, MLAAttentionSpec),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
    )


def host_num_pages(cfg: HiCacheConfig, geom: KVGeometry) -> int:
    """L2 pages: hicache_size GB per rank if set, else hicache_ratio x L1.

    Equal in every process of one engine. By size: the largest pipeline
    stage's page bytes divide it (so that stage's pool fits hicache_size and
    smaller stages use less). By ratio: vLLM gives every worker, and the
    scheduler, the smallest num_blocks among the workers
    (``get_kv_cache_configs``; ``generate_scheduler_kv_cache_config`` asserts
    they agree), so pages = ratio x num_blocks agree whatever the stage.
    """
    if cfg.host_bytes_override > 0:
        bytes_per_page = max(1, geom.sizing_bytes_per_block)
        num_pages = cfg.host_bytes_override // bytes_per_page
        if num_pages < 1:
            raise ValueError(
                f"hicache_size={cfg.hicache_size} GB holds no page: one page "
                f"(a block of all {geom.sizing_num_layers or geom.num_layers} layers"
                f"{' of the largest pipeline stage' if geom.sizing_num_layers else ''}) is "
                f"{bytes_per_page} bytes"
            )
        return int(num_pages)
    return int(geom.num_l1_blocks * cfg.hicache_ratio)
