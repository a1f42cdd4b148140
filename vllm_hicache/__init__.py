"""vllm_hicache: SGLang's HiCache (hierarchical KV cache) as a vLLM KV connector.

Use with ``kv_connector="HiCacheConnector"`` and
``kv_connector_module_path="vllm_hicache"``. The connector is imported lazily
so that the pure core (index/, policy/, config, keys) imports without torch
or vllm.
"""

__all__ = ["HiCacheConnector"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "HiCacheConnector":
        from vllm_hicache.connector import HiCacheConnector

        return HiCacheConnector
    raise AttributeError(f"module 'vllm_hicache' has no attribute {name!r}")
