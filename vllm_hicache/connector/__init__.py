"""vLLM glue: the connector and its two halves. The only package importing vllm."""

from vllm_hicache.connector.connector import HiCacheConnector

__all__ = ["HiCacheConnector"]
