"""Host (L2) KV pool: buffer, layouts, sizing. See ``pool.py`` and ``layout.py``.

The public names below are loaded on first use (PEP 562), so that importing
the pure ``layout_names`` (which ``config.py`` does) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_hicache.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from vllm_hicache.host.layout import BlockOrder, HostLayout, page_bytes, pool_bytes
    from vllm_hicache.host.layout_names import MEM_LAYOUTS, NATIVE_LAYOUTS
    from vllm_hicache.host.memory import MemInfo, check_fits, read_meminfo, reserve_bytes
    from vllm_hicache.host.pool import HostKVPool

# Public name -> the submodule that defines it.
_HOMES = {
    "MEM_LAYOUTS": "layout_names",
    "NATIVE_LAYOUTS": "layout_names",
    "BlockOrder": "layout",
    "HostLayout": "layout",
    "page_bytes": "layout",
    "pool_bytes": "layout",
    "MemInfo": "memory",
    "check_fits": "memory",
    "read_meminfo": "memory",
    "reserve_bytes": "memory",
    "HostKVPool": "pool",
}

# Literal, so type checkers see the re-exports.
__all__ = [
    "BlockOrder",
    "HostKVPool",
    "HostLayout",
    "MEM_LAYOUTS",
    "MemInfo",
    "NATIVE_LAYOUTS",
    "check_fits",
    "page_bytes",
    "pool_bytes",
    "read_meminfo",
    "reserve_bytes",
]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
