"""Backend registry: name -> (module, class), imported on first use.

The names registered here, plus ``dynamic`` (a user's class, storage/dynamic.py),
are the accepted values of ``hicache_storage_backend``: the configuration
asks ``backend_names()``, so a backend registered here is accepted there.
Pure module: nothing is imported until a backend is built, so the
configuration layer imports it without numpy or a backend's client library.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from vllm_hicache.storage import dynamic
from vllm_hicache.storage.base import StorageBackend, StorageContext

_REGISTRY: dict[str, tuple[str, str]] = {}


def register_backend(name: str, module: str, class_name: str) -> None:
    if name in _REGISTRY or name == dynamic.NAME:
        raise ValueError(f"storage backend {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)


def backend_names() -> tuple[str, ...]:
    """Every accepted ``hicache_storage_backend``, in registration order."""
    return (*_REGISTRY, dynamic.NAME)


def create_backend(name: str, options: Mapping[str, Any], ctx: StorageContext) -> StorageBackend:
    """Build the backend ``name`` (a value of ``hicache_storage_backend``)."""
    options = dict(options)
    if name == dynamic.NAME:
        cls = dynamic.load_user_backend(options)
    elif name in _REGISTRY:
        module, class_name = _REGISTRY[name]
        cls = getattr(importlib.import_module(module), class_name)
    else:
        raise ValueError(
            f"unknown hicache_storage_backend {name!r}; accepted: {', '.join(backend_names())}"
        )
    return cls(options, ctx)


register_backend("file", "vllm_hicache.storage.file.backend", "FileBackend")
register_backend("redis", "vllm_hicache.storage.redis.backend", "RedisBackend")
register_backend("mooncake", "vllm_hicache.storage.mooncake.backend", "MooncakeBackend")
register_backend("nixl", "vllm_hicache.storage.nixl.backend", "NixlBackend")
