"""KV cache events as vLLM publishes them: ``common/events.py``'s record,
made of vLLM's ``BlockStored``/``BlockRemoved`` with block hashes converted
as vLLM converts them (``maybe_convert_block_hash``), so they match its own
``GPU`` events. The tiers, media and bounds are ``common/events.py``'s.
"""

from __future__ import annotations

from typing import Any

from vllm_hicache.common.events import (  # noqa: F401 - this module's public names too
    MAX_EVENTS,
    MEDIUM_L2,
    MEDIUM_L3,
    EventLog,
    contiguous_runs,
)


def kv_events_enabled(vllm_config) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


class KVEventLog(EventLog):
    """The event log of an engine with vLLM's KV events on (or off)."""

    def __init__(self, enabled: bool, block_size: int, max_events: int = MAX_EVENTS) -> None:
        super().__init__(enabled, block_size, max_events)
        if enabled:
            from vllm.distributed.kv_events import BlockRemoved, BlockStored
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            self._stored_cls, self._removed_cls = BlockStored, BlockRemoved
            self._convert_hash = maybe_convert_block_hash

    def _convert(self, block_hash: bytes) -> Any:
        return self._convert_hash(block_hash)

    def _stored_event(self, **fields: Any) -> Any:
        return self._stored_cls(**fields)

    def _removed_event(self, **fields: Any) -> Any:
        return self._removed_cls(**fields)
