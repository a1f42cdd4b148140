"""Host (L2) KV pool: buffer, layouts, sizing. See ``pool.py`` and ``layout.py``."""

from vllm_hicache.host.layout import (
    MEM_LAYOUTS,
    NATIVE_LAYOUTS,
    BlockOrder,
    HostLayout,
    page_bytes,
    pool_bytes,
)
from vllm_hicache.host.memory import MemInfo, check_fits, read_meminfo, reserve_bytes
from vllm_hicache.host.pool import HostKVPool

__all__ = [
    "MEM_LAYOUTS",
    "NATIVE_LAYOUTS",
    "BlockOrder",
    "HostKVPool",
    "HostLayout",
    "MemInfo",
    "check_fits",
    "page_bytes",
    "pool_bytes",
    "read_meminfo",
    "reserve_bytes",
]
