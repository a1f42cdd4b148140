"""L3 storage tier: one interface, an object format, one subpackage per backend.

    base.py        StorageBackend (the interface) and StorageContext
    factory.py     the registry: backend name -> class, imported on first use
    dynamic.py     ``dynamic``: a user's StorageBackend subclass by module path
    format.py      an object's 64-byte header; sealing.py: its check (codecs)
    pages.py       host pages <-> sealed objects, for one worker
    options.py     typed option parsing for every backend's config dataclass
    counters.py  log_throttle.py  batching.py  buffers.py   shared by backends
    file/  redis/  mooncake/  nixl/    the backends: backend.py + config.py + parts

This package and base.py, factory.py, dynamic.py and options.py import
without numpy: the configuration layer asks the registry for backend names.
"""

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
