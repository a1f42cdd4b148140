"""L3 storage tier: one interface (base.py), an object format (format.py), backends."""

from vllm_hicache.storage.base import Buffers, StorageBackend, StorageContext
from vllm_hicache.storage.factory import backend_names, create_backend, register_backend

__all__ = [
    "Buffers",
    "StorageBackend",
    "StorageContext",
    "backend_names",
    "create_backend",
    "register_backend",
]
