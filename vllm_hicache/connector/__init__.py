"""vLLM's face: the connector class vLLM builds, its worker half, and the
modules that speak vLLM's types (metadata envelopes, metrics, KV events,
geometry, compatibility shims).

``HiCacheConnector`` is imported on first use, so that the lower floors
(the scheduler half, the L3 tier) can import ``connector.geometry`` or
``connector.vllm_compat`` without pulling in the dispatcher above them.
``kv_connector_module_path="vllm_hicache.connector"`` keeps working.
"""

__all__ = ["HiCacheConnector"]


def __getattr__(name: str):
    if name == "HiCacheConnector":
        from vllm_hicache.connector.connector import HiCacheConnector

        return HiCacheConnector
    raise AttributeError(f"module 'vllm_hicache.connector' has no attribute {name!r}")
